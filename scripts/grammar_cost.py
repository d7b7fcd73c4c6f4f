"""What a grammar engine costs per token on this CPU, and which JSON-schema features it enforces: llguidance against
xgrammar, with a real tokenizer (Qwen2.5's, 151,936 ids).

For each schema it compiles the grammar for the tokenizer, then walks a valid document token by token (its own
canonical tokenization) the way a decode loop would: fill the next-token mask, check the document's token is in it,
accept the token. It reports compile time, the mask fill (mean, p50, p99), accept, a 4-token rollback, and a
speculative window (masks at the committed state and after each of 4 drafts, then rollback), which is what one
round of structured speculation asks of the grammar per sequence. A third row measures llguidance through
`specdec_core.grammar`, as the engine will use it: masks as [V] bool tensors, each position's computed once (the
window's masks serve the steps after it, so its mask column is mostly unpacking bits into a tensor).

Coverage: for each schema keyword, a schema using it, a document that satisfies it and one that breaks only it.
`enforced`: the first is accepted, the second rejected; `ignored`: both accepted (the keyword is dropped
silently); `error`: the compiler refuses the schema; `wrong`: the valid document is rejected.

    PYTHONPATH=. python scripts/grammar_cost.py --json docs/bench/grammar_cost.json

xgrammar is not a dependency of the project: install it beside (`pip install --target DIR --no-deps xgrammar
apache-tvm-ffi`, then DIR on PYTHONPATH) to compare; without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from importlib.metadata import version

import numpy as np
import torch

SCHEMAS = {
    "flat": (
        {"type": "object", "additionalProperties": False, "required": ["id", "name", "active", "role"],
         "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "active": {"type": "boolean"},
                        "role": {"enum": ["admin", "editor", "viewer"]}, "score": {"type": "number"}}},
        {"id": 4821, "name": "Ada Lovelace", "active": True, "role": "editor", "score": 0.875},
    ),
    "nested": (
        {"type": "object", "additionalProperties": False, "required": ["order_id", "customer", "items"],
         "properties": {
             "order_id": {"type": "string"},
             "customer": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
                          "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                         "address": {"type": "object", "additionalProperties": False,
                                                     "required": ["city", "zip"],
                                                     "properties": {"street": {"type": "string"},
                                                                    "city": {"type": "string"},
                                                                    "zip": {"type": "string"}}}}},
             "items": {"type": "array", "items": {
                 "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                 "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
                                "status": {"enum": ["pending", "shipped", "delivered", "returned"]}}}},
             "notes": {"type": ["string", "null"]}}},
        {"order_id": "A-2024-0193", "customer": {"name": "Grace Hopper", "email": "grace@example.com",
                                                 "address": {"street": "1 Navy Way", "city": "Arlington",
                                                             "zip": "22202"}},
         "items": [{"sku": "KB-101", "qty": 2, "price": 49.99, "tags": ["keyboard", "usb"], "status": "shipped"},
                   {"sku": "MS-7", "qty": 1, "price": 19.5, "status": "pending"},
                   {"sku": "CB-3", "qty": 10, "price": 2.25, "tags": []}],
         "notes": None},
    ),
    "records": (
        {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                    "required": ["t", "level", "msg"],
                                    "properties": {"t": {"type": "integer"},
                                                   "level": {"enum": ["debug", "info", "warning", "error"]},
                                                   "msg": {"type": "string"},
                                                   "latency_ms": {"type": "number"}}}},
        [{"t": 1700000000 + i, "level": ["info", "debug", "warning"][i % 3],
          "msg": f"request {i} served from replica {i % 4}", "latency_ms": 12.5 + i} for i in range(8)],
    ),
}

# keyword: (schema, a document satisfying it, a document breaking only it)
FEATURES = {
    "enum": ({"enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": "x"}, "x", "y"),
    "type-array": ({"type": ["integer", "null"]}, None, "s"),
    "additionalProperties:false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1}, {"a": 1, "b": 2}),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["b"], "additionalProperties": False}, {"b": 1}, {"a": 1}),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 10}, 7, 11),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd"),
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}, "abc-12", "abc-123"),
    "format:date": ({"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    "format:email": ({"type": "string", "format": "email"}, "a@b.io", "not an email"),
    "format:uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123"),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                    [1, "a"], ["a", 1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "$ref/$defs": ({"$defs": {"pos": {"type": "integer", "minimum": 0}}, "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/pos"}}, "required": ["a"], "additionalProperties": False},
                   {"a": 3}, {"a": -3}),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["v"],
                                           "properties": {"v": {"type": "integer"},
                                                          "kids": {"type": "array",
                                                                   "items": {"$ref": "#/$defs/node"}}}}},
                        "$ref": "#/$defs/node"},
                       {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"v": "x"}]}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", True),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 3, "a"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, 3, 9),
    "not": ({"type": "integer", "not": {"const": 3}}, 4, 3),
    "if/then/else": ({"type": "object", "if": {"properties": {"a": {"const": 1}}},
                      "then": {"required": ["b"]}, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
                     {"a": 1, "b": 2}, {"a": 1}),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                      {"a": 1, "b": 2}, {"a": 1}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
}

WINDOW = 4  # drafts per speculative window


class Lib:
    """One grammar engine behind the few calls the measurements need."""

    name: str
    tokenizer_s: float  # building its tokenizer-side tables, once per tokenizer
    eos: int

    def compile(self, kind: str, value: str): ...
    def matcher(self, grammar): ...
    def fill(self, m): ...  # the next-token mask, in the library's own form
    def allowed(self, mask, token: int) -> bool: ...
    def accept(self, m, token: int) -> bool: ...
    def rollback(self, m, n: int) -> None: ...
    def accepting(self, m) -> bool: ...


class Packed(Lib):
    """A library that fills a packed bitmask (32 tokens per int32), as both do."""

    def __init__(self, name: str, tokenizer_s: float, vocab: int, eos: int) -> None:
        self.name, self.tokenizer_s, self.eos = name, tokenizer_s, eos
        self.buf = torch.zeros((vocab + 31) // 32, dtype=torch.int32)  # [W]

    def allowed(self, mask, token):
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class Llguidance(Packed):
    def __init__(self, hf_tokenizer, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
        super().__init__("llguidance " + version("llguidance"), time.perf_counter() - t0, vocab, eos)

    def compile(self, kind, value):
        M = self.llg.LLMatcher
        grammar = {"json_schema": M.grammar_from_json_schema, "regex": M.grammar_from_regex,
                   "lark": M.grammar_from_lark}[kind](value)
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m):
        m.unsafe_compute_mask_ptr(self.buf.data_ptr(), self.buf.numel() * 4)
        return self.buf

    def accept(self, m, token):
        return m.try_consume_tokens([token]) == 1

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_accepting()


class Xgrammar(Packed):
    def __init__(self, hf_tokenizer, vocab: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        super().__init__("xgrammar " + version("xgrammar"), time.perf_counter() - t0, vocab, eos)
        # The compiler's own cache is off so that every compile below is measured cold.
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind, value):
        c = self.compiler
        return {"json_schema": c.compile_json_schema, "regex": c.compile_regex, "lark": c.compile_lark}[kind](value)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m):
        m.fill_next_token_bitmask(self.buf.view(1, -1), 0)
        return self.buf

    def accept(self, m, token):
        return m.accept_token(token)

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_completed()


class Core(Lib):
    """specdec_core.grammar as the engine uses it: [V] bool masks, each position's mask computed once (so a
    window's masks serve the next step too), eos handled by the state."""

    def __init__(self, hf_tokenizer, vocab: int, eos: int) -> None:
        from specdec_core.grammar.compiler import GrammarCompiler

        t0 = time.perf_counter()
        self.compiler = GrammarCompiler(hf_tokenizer, vocab, [eos], cache_size=0)  # no cache: compiles measured cold
        self.name, self.tokenizer_s, self.eos = "specdec_core.grammar", time.perf_counter() - t0, eos

    def compile(self, kind, value):
        from specdec_core.grammar.constraint import Constraint

        return self.compiler.compile(Constraint("grammar" if kind == "lark" else kind, value))

    def matcher(self, grammar):
        from specdec_core.grammar.state import GrammarState

        return GrammarState(grammar)

    def fill(self, m):
        return m.allowed_mask()

    def allowed(self, mask, token):
        return bool(mask[token])

    def accept(self, m, token):
        return m.advance([token]) == 1

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.can_end()


def _stats_us(ns: list[int]) -> dict:
    s = sorted(ns)
    return {"mean": round(statistics.fmean(s) / 1e3, 1), "p50": round(s[len(s) // 2] / 1e3, 1),
            "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3, 1)}


def walk(lib: Lib, kind: str, value: str, tokens: list[int], repeats: int) -> dict:
    """Compile, then walk the document `repeats` times, timing each grammar call."""
    t0 = time.perf_counter()
    grammar = lib.compile(kind, value)
    m = lib.matcher(grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter_ns()
    lib.fill(m)
    first_mask_us = (time.perf_counter_ns() - t0) / 1e3
    fill, accept, rollback, window = [], [], [], []
    for _ in range(repeats):
        m = lib.matcher(grammar)
        for i, token in enumerate(tokens):
            t0 = time.perf_counter_ns()
            mask = lib.fill(m)
            fill.append(time.perf_counter_ns() - t0)
            assert lib.allowed(mask, token), f"{lib.name}: document token {i} ({token}) not in the mask"
            t0 = time.perf_counter_ns()
            assert lib.accept(m, token)
            accept.append(time.perf_counter_ns() - t0)
            drafts = tokens[i + 1 : i + 1 + WINDOW]
            if len(drafts) == WINDOW:  # one speculative round from here: the masks at 0..k, then undo
                t0 = time.perf_counter_ns()
                for d in drafts:
                    lib.fill(m)
                    lib.accept(m, d)
                lib.fill(m)
                t1 = time.perf_counter_ns()
                lib.rollback(m, WINDOW)
                t2 = time.perf_counter_ns()
                window.append(t2 - t0)
                rollback.append(t2 - t1)
        assert lib.accepting(m) and lib.allowed(lib.fill(m), lib.eos), f"{lib.name}: cannot end after the document"
    return {"tokens": len(tokens), "compile_ms": round(compile_ms, 2), "first_mask_us": round(first_mask_us, 1),
            "mask_us": _stats_us(fill), "accept_us": _stats_us(accept),
            f"rollback{WINDOW}_us": _stats_us(rollback), f"window{WINDOW}_us": _stats_us(window)}


def accepts(lib: Lib, grammar, tokens: list[int]) -> bool:
    m = lib.matcher(grammar)
    return all(lib.accept(m, t) for t in tokens) and lib.accepting(m)


def coverage(lib: Lib, tokenizer) -> dict[str, str]:
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        try:
            grammar = lib.compile("json_schema", json.dumps(schema))
            lib.matcher(grammar)
        except Exception as e:  # each library has its own error types; the message is what matters here
            out[name] = "error: " + str(e).splitlines()[0][:90]
            continue
        ok, wrong = (accepts(lib, grammar, tokenizer.encode(json.dumps(doc), add_special_tokens=False))
                     for doc in (good, bad))
        out[name] = "wrong" if not ok else ("ignored" if wrong else "enforced")
    return out


def to_bool_cost(vocab: int, n: int = 200) -> dict:
    """Our side of every mask: the packed bitmask unpacked into a [V] bool tensor, as the engine uses it."""
    from specdec_core.grammar.bits import unpack_bitmask

    buf = np.random.default_rng(0).integers(0, 2**32, (vocab + 31) // 32, dtype=np.uint32)  # [W]
    ns = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        unpack_bitmask(buf, vocab)
        ns.append(time.perf_counter_ns() - t0)
    return _stats_us(ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from specdec_core.models.loader import load_tokenizer

    loaded = load_tokenizer(args.model)
    tokenizer, vocab = loaded.tokenizer, int(loaded.hf_config["vocab_size"])
    eos = tokenizer.eos_token_id
    libs: list[Lib] = [Llguidance(tokenizer, vocab, eos)]
    try:
        libs.append(Xgrammar(tokenizer, vocab, eos))
    except ImportError:
        print("xgrammar not importable: measuring llguidance only")
    libs.append(Core(tokenizer, vocab, eos))
    torch.set_num_threads(1)

    cases = {name: ("json_schema", json.dumps(schema), json.dumps(doc)) for name, (schema, doc) in SCHEMAS.items()}
    cases["json_object"] = ("json_schema", json.dumps({"type": "object"}), json.dumps(SCHEMAS["nested"][1]))
    cases["regex"] = ("regex", r"[0-9]{3}-[0-9]{4} (ok|fail|retry): [a-z ]{1,40}",
                      "555-0199 retry: upstream timed out after three tries")
    cases["lark"] = ("lark", 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\n'
                             "NUMBER: /[0-9]+/\n", "(12+7)-(3-(40+2))+100")
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": 1,
                           "load_average": os.getloadavg()[0],  # other work on the machine makes the tails noisy
                           "tokenizer": args.model, "vocab": vocab},
               "to_bool_us": to_bool_cost(vocab), "libraries": {}}
    for lib in libs:
        r = {"tokenizer_info_s": round(lib.tokenizer_s, 2), "cases": {}, "coverage": coverage(lib, tokenizer)}
        for name, (kind, value, doc) in cases.items():
            tokens = tokenizer.encode(doc, add_special_tokens=False)
            r["cases"][name] = walk(lib, kind, value, tokens, args.repeats)
        results["libraries"][lib.name] = r

    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


def _print(results: dict) -> None:
    libs = results["libraries"]
    print(f"tokenizer {results['machine']['tokenizer']}, vocab {results['machine']['vocab']}; "
          f"bitmask -> bool[V]: {results['to_bool_us']['mean']} us")
    head = f"{'library':<22}{'case':<13}{'tok':>5}{'compile ms':>11}{'mask mean':>10}{'p50':>7}{'p99':>8}" \
           f"{'accept':>8}{'rb4':>7}{'window4':>9}  (us)"
    print(head)
    for lib, r in libs.items():
        print(f"{lib:<22}tokenizer info {r['tokenizer_info_s']} s")
        for case, c in r["cases"].items():
            m = c["mask_us"]
            print(f"{lib:<22}{case:<13}{c['tokens']:>5}{c['compile_ms']:>11}{m['mean']:>10}{m['p50']:>7}"
                  f"{m['p99']:>8}{c['accept_us']['mean']:>8}{c['rollback4_us']['mean']:>7}"
                  f"{c['window4_us']['mean']:>9}")
    print(f"\n{'keyword':<28}" + "".join(f"{lib:<48}" for lib in libs))
    for feature in FEATURES:
        print(f"{feature:<28}" + "".join(f"{r['coverage'][feature]:<48}" for r in libs.values()))


if __name__ == "__main__":
    main()

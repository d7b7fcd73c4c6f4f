"""llama-server for `specdec bench peer`, without one: its command lines, the speculation types read from its help, and
a server that exits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdec_tools.bench import peer_llama as llama

SETUP = llama.LlamaSetup(Path("bin/llama-server"), Path("t.gguf"), (Path("d.gguf"),), threads=2)
HELP = """\
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-type none,draft-simple,draft-eagle3,ngram-simple,ngram-map-k,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use (default:
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
"""


# -- llama-server ----------------------------------------------------------------------------------------------------


def test_the_plain_server_command_gives_every_slot_the_same_context():
    command = llama.server_command(SETUP, llama.LlamaSpeculation(), port=8090, parallel=4)
    assert command == [
        "bin/llama-server",
        "-m",
        "t.gguf",
        "--port",
        "8090",
        "-c",
        str(4 * llama.CONTEXT_PER_SLOT),
        "-t",
        "2",
        "-np",
        "4",
    ]


def test_a_draft_setting_adds_the_draft_model_its_type_and_n_max():
    (setting,) = llama.draft_sweep([5], SETUP.draft_ggufs)
    command = llama.server_command(SETUP, setting, port=1, parallel=1)
    assert command[-6:] == ["-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "5"]
    assert setting.name == "draft-simple n-max 5"


def test_several_drafts_are_swept_at_every_n_max_each_named_by_its_file():
    settings = llama.draft_sweep([3, 8], [Path("m/draft-q8_0.gguf"), Path("m/draft-q4_0.gguf")])
    assert [s.name for s in settings] == [
        "draft-simple n-max 3 (draft-q8_0)",
        "draft-simple n-max 8 (draft-q8_0)",
        "draft-simple n-max 3 (draft-q4_0)",
        "draft-simple n-max 8 (draft-q4_0)",
    ]
    command = llama.server_command(SETUP, settings[2], port=1, parallel=1)
    assert command[-6:-4] == ["-md", "m/draft-q4_0.gguf"]


def test_an_ngram_setting_names_its_type_and_loads_no_draft():
    command = llama.server_command(SETUP, llama.LlamaSpeculation("ngram-mod"), port=1, parallel=1)
    assert command[-2:] == ["--spec-type", "ngram-mod"]
    assert "-md" not in command


def test_the_speculation_types_are_read_from_the_binarys_help():
    assert llama.spec_types(HELP)[:2] == ("none", "draft-simple")
    assert llama.ngram_types(HELP) == ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
    assert llama.ngram_types("no such flag here") == ()


def test_a_server_that_exits_is_an_error_quoting_its_log():
    command = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3") as failure, llama.llama_server(command, port=1):
        pass
    assert "no such model" in str(failure.value)

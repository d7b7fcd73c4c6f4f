"""Hand-written structural schemas for the kinds whose CRDs are not in ../shared/k8s-schemas: Gateway API
(gateway.networking.k8s.io/v1: Gateway, GRPCRoute, HTTPRoute), cert-manager (cert-manager.io/v1: Certificate,
Issuer) and the Prometheus Operator (monitoring.coreos.com/v1: PrometheusRule). Each carries the required fields,
enums and bounds of the upstream CRD for the parts these manifests use, and lists the field names allowed at those
levels, so that a missing or misspelt key fails here as it would against the real CRD. Field names are those of
Gateway API's standard channel (v1.6), of cert-manager's v1 CRDs and of the operator's PrometheusRule; fields we
do not use are allowed but not described ({}). A few rules that upstream enforces by CEL or by cert-manager's
webhook are written as schema here (a GRPCRoute method names a service or a method; an Issuer has one way of
issuing; key sizes; a rule is an alert or a recording rule, not both). Two are stricter than upstream: a listener's
protocol must be a core one (upstream also takes implementation-specific names), and cert-manager's durations use
Go's h, m, s and ms units only (a PrometheusRule's take Prometheus's own, y to ms)."""

from __future__ import annotations

ANY: dict = {}
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
STRING = {"type": "string", "minLength": 1}


def obj(required: tuple[str, ...] = (), **properties) -> dict:
    """An object with exactly these fields (Python names: a trailing _ is dropped, so `from_` is `from`)."""
    return {
        "type": "object",
        "required": list(required),
        "additionalProperties": False,
        "properties": {k.rstrip("_"): v for k, v in properties.items()},
    }


def array(items: dict, min_items: int = 0, max_items: int | None = None) -> dict:
    schema = {"type": "array", "items": items, "minItems": min_items}
    return schema | ({"maxItems": max_items} if max_items is not None else {})


def resource(api_version: str, kind: str, spec: dict) -> dict:
    return obj(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=obj(
            ("name",),
            name={"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
            namespace=STRING,
            labels={"type": "object"},
            annotations={"type": "object"},
        ),
        spec=spec,
    )


# --- Gateway API v1 -------------------------------------------------------------------------------------------------
SECRET_REF = obj(("name",), group={"type": "string"}, kind=STRING, name=STRING, namespace=STRING)
PARENT_REF = obj(
    ("name",),
    group={"type": "string"},
    kind=STRING,
    namespace=STRING,
    name=STRING,
    sectionName={"type": "string", "pattern": DNS_LABEL},
    port=PORT,
)
BACKEND_REF = obj(
    ("name",),
    group={"type": "string"},
    kind=STRING,
    name=STRING,
    namespace=STRING,
    port=PORT,
    weight={"type": "integer", "minimum": 0, "maximum": 1000000},
    filters=ANY,
)
LISTENER = obj(
    ("name", "port", "protocol"),
    name={"type": "string", "pattern": DNS_LABEL, "maxLength": 253},
    hostname={"type": "string", "pattern": HOSTNAME, "maxLength": 253},
    port=PORT,
    protocol={"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},  # the core ones (upstream also takes domain/Name)
    tls=obj((), mode={"enum": ["Terminate", "Passthrough"]}, certificateRefs=array(SECRET_REF, 0, 64), options=ANY),
    allowedRoutes=obj(
        (),
        namespaces=obj((), from_={"enum": ["All", "Selector", "Same"]}, selector=ANY),
        kinds=array(obj(("kind",), group={"type": "string"}, kind=STRING), 0, 8),
    ),
)
# At least one of service and method, and (for Exact) the characters they may hold: CEL rules upstream.
GRPC_METHOD = obj(
    (),
    type={"enum": ["Exact", "RegularExpression"]},
    service={"type": "string", "pattern": r"^\.?[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)*$"},
    method={"type": "string", "pattern": r"^[A-Za-z_][A-Za-z_0-9]*$"},
) | {"anyOf": [{"required": ["service"]}, {"required": ["method"]}]}
GATEWAY = resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    obj(
        ("gatewayClassName", "listeners"),
        gatewayClassName={"type": "string", "minLength": 1, "maxLength": 253},
        listeners=array(LISTENER, 1, 64),
        addresses=ANY,
        infrastructure=ANY,
        allowedListeners=ANY,
        tls=ANY,
    ),
)
GRPC_ROUTE = resource(
    "gateway.networking.k8s.io/v1",
    "GRPCRoute",
    obj(
        (),
        parentRefs=array(PARENT_REF, 0, 32),
        hostnames=array({"type": "string", "pattern": HOSTNAME}, 0, 16),
        rules=array(
            obj(
                (),
                name=ANY,
                matches=array(obj((), method=GRPC_METHOD, headers=ANY), 0, 64),
                filters=ANY,
                backendRefs=array(BACKEND_REF, 0, 16),
            ),
            0,
            16,
        ),
    ),
)
HTTP_ROUTE = resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    obj(
        (),
        parentRefs=array(PARENT_REF, 0, 32),
        hostnames=array({"type": "string", "pattern": HOSTNAME}, 0, 16),
        rules=array(
            obj(
                (),
                name=ANY,
                matches=array(
                    obj(
                        (),
                        path=obj(
                            (),
                            type={"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                            value={"type": "string", "pattern": "^/", "maxLength": 1024},
                        ),
                        headers=ANY,
                        queryParams=ANY,
                        method=ANY,
                    ),
                    0,
                    64,
                ),
                filters=ANY,
                backendRefs=array(BACKEND_REF, 0, 16),
                timeouts=ANY,
            ),
            0,
            16,
        ),
    ),
)

# --- cert-manager v1 ------------------------------------------------------------------------------------------------
ISSUER_REF = obj(("name",), name=STRING, kind=STRING, group=STRING)
CERTIFICATE = resource(
    "cert-manager.io/v1",
    "Certificate",
    obj(
        ("secretName", "issuerRef"),
        secretName=STRING,
        issuerRef=ISSUER_REF,
        commonName={"type": "string"},
        dnsNames=array({"type": "string", "minLength": 1}),
        ipAddresses=array(STRING),
        uris=array(STRING),
        emailAddresses=array(STRING),
        otherNames=ANY,
        literalSubject=ANY,
        subject=ANY,
        nameConstraints=ANY,
        isCA={"type": "boolean"},
        duration={"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"},
        renewBefore={"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s|ms))+$"},
        renewBeforePercentage={"type": "integer"},
        privateKey=obj(
            (),
            algorithm={"enum": ["RSA", "ECDSA", "Ed25519"]},
            size={"enum": [256, 384, 521, 2048, 4096, 8192]},
            encoding={"enum": ["PKCS1", "PKCS8"]},
            rotationPolicy={"enum": ["Never", "Always"]},
        ),
        usages=array(
            {
                "enum": [
                    "signing",
                    "digital signature",
                    "content commitment",
                    "key encipherment",
                    "key agreement",
                    "data encipherment",
                    "cert sign",
                    "crl sign",
                    "encipher only",
                    "decipher only",
                    "any",
                    "server auth",
                    "client auth",
                    "code signing",
                    "email protection",
                    "s/mime",
                    "ipsec end system",
                    "ipsec tunnel",
                    "ipsec user",
                    "timestamping",
                    "ocsp signing",
                    "microsoft sgc",
                    "netscape sgc",
                ]
            }
        ),
        additionalOutputFormats=ANY,
        encodeUsagesInRequest={"type": "boolean"},
        keystores=ANY,
        revisionHistoryLimit={"type": "integer"},
        secretTemplate=ANY,
        signatureAlgorithm=ANY,
    ),
)
ISSUER_KINDS = ("acme", "ca", "selfSigned", "vault", "venafi")
ISSUER = resource(
    "cert-manager.io/v1",
    "Issuer",
    obj(
        (),
        selfSigned=obj((), crlDistributionPoints=array(STRING)),
        ca=obj(
            ("secretName",), secretName=STRING, crlDistributionPoints=ANY, ocspServers=ANY, issuingCertificateURLs=ANY
        ),
        acme=ANY,
        vault=ANY,
        venafi=ANY,
    )
    | {"minProperties": 1, "maxProperties": 1},
)  # exactly one way of issuing

# --- Prometheus Operator v1 ------------------------------------------------------------------------------------------
DURATION = {
    "type": "string",  # Prometheus's own units, largest first (the CRD's pattern)
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
RULE = obj(
    ("expr",),
    alert=STRING,
    record=STRING,
    expr={"type": ["string", "integer"], "minLength": 1},
    for_=DURATION,
    keep_firing_for=DURATION,
    labels=STRING_MAP,
    annotations=STRING_MAP,
) | {
    "oneOf": [
        {"required": ["alert"], "not": {"required": ["record"]}},
        {"required": ["record"], "not": {"required": ["alert"]}},
    ]
}
PROMETHEUS_RULE = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    obj(
        ("groups",),
        groups=array(
            obj(
                ("name",),
                name=STRING,
                interval=DURATION,
                query_offset=DURATION,
                limit={"type": "integer"},
                partial_response_strategy={"type": "string"},
                labels=STRING_MAP,
                rules=array(RULE),
            ),
            1,
        ),
    ),
)

SHAPES = {
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY,
    ("gateway.networking.k8s.io/v1", "GRPCRoute"): GRPC_ROUTE,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
    ("cert-manager.io/v1", "Certificate"): CERTIFICATE,
    ("cert-manager.io/v1", "Issuer"): ISSUER,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
}

"""Run by tests/deploy/test_deploy.py under the deploy venv (.venv-deploy: `make deploy-env`), which holds the real tools:
kubernetes-validate (Kubernetes' OpenAPI schemas), jsonschema on the vendored CRD schemas, promql-parser.

    python tests/deploy_tools.py validate K8S_VERSION < manifests.json   -> [{"kind", "name", "error"}, ...]
    python tests/deploy_tools.py promql < expressions.json               -> [{"ok", "error", "names"}, ...]

Input and output are JSON on stdin / stdout, so the test (in the main venv) keeps every assertion.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parent.parent / "deploy" / "schemas"
CRDS = {  # (apiVersion, kind) -> vendored schema (deploy/schemas/SOURCES.md)
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-leaderworkerset.x-k8s.io-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
}


def strict(schema):
    """A CRD schema that refuses unknown fields, as the API server's strict field validation does: every object
    that lists its properties and neither allows extra ones nor preserves unknown fields gets
    additionalProperties: false."""
    s = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(s)
    return s


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """A LeaderWorkerSet's pod templates, as v1 PodTemplate objects Kubernetes' own schema can check."""
    lwt = doc.get("spec", {}).get("leaderWorkerTemplate", {})
    out = []
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            out.append(
                (
                    key,
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": key.lower()},
                        "template": lwt[key],
                    },
                )
            )
    return out


def validate(docs: list[dict], version: str) -> list[dict]:
    import jsonschema
    import kubernetes_validate

    validators = {}
    errors = []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            if key in CRDS:
                if key not in validators:
                    schema = strict(json.loads((SCHEMAS / CRDS[key]).read_text()))
                    validators[key] = jsonschema.Draft202012Validator(schema)
                for e in validators[key].iter_errors(doc):
                    errors.append({"kind": key[1], "name": name, "error": f"{list(e.absolute_path)}: {e.message}"})
                for part, template in pod_templates(doc):
                    kubernetes_validate.validate(template, version, strict=True)
            else:
                kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append({"kind": key[1], "name": name, "error": f"no schema for {key}: {e}"})
        except kubernetes_validate.ValidationError as e:
            errors.append({"kind": key[1], "name": name, "error": f"{list(e.path)}: {e.message}"})
    return errors


def promql(exprs: list[str]) -> list[dict]:
    import promql_parser

    out = []
    for expr in exprs:
        try:
            tree = promql_parser.parse(expr)
        except ValueError as e:
            out.append({"ok": False, "error": str(e), "names": []})
            continue
        names: list[str] = []

        def visit(node, names=names):
            if isinstance(node, promql_parser.VectorSelector) and node.name:
                names.append(node.name)

        promql_parser.walk(tree, visit)
        out.append({"ok": True, "error": None, "names": sorted(set(names))})
    return out


if __name__ == "__main__":
    cmd = sys.argv[1]
    data = json.load(sys.stdin)
    result = validate(data, sys.argv[2]) if cmd == "validate" else promql(data)
    json.dump(result, sys.stdout)

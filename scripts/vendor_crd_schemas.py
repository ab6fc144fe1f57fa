"""Vendor the JSON schemas of the custom resources deploy/k8s uses, from the projects' own CRD manifests.

    python scripts/vendor_crd_schemas.py CRD.yaml... --source REPO@COMMIT:PATH...

Each CRD's served versions' `openAPIV3Schema` is written unchanged (as JSON) to
deploy/schemas/<kind>-<group>-<version>.json; tests/deploy/test_deploy.py validates the rendered manifests against
them (and makes them strict: an unknown field is an error). deploy/schemas/SOURCES.md records where each came
from (repository, commit, path, licence): update it when re-vendoring.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent.parent / "deploy" / "schemas"


def schemas(crd: dict) -> dict[str, dict]:
    spec = crd["spec"]
    kind, group = spec["names"]["kind"], spec["group"]
    out = {}
    for version in spec["versions"]:
        if version.get("served", True):
            out[f"{kind.lower()}-{group}-{version['name']}.json"] = version["schema"]["openAPIV3Schema"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("crds", nargs="+", type=Path)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for path in args.crds:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                for name, schema in schemas(doc).items():
                    (OUT / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
                    print(name)


if __name__ == "__main__":
    main()

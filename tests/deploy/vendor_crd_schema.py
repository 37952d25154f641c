"""Extracts one served version's OpenAPI v3 schema from a CRD manifest into a JSON data file.

Used once per upgrade of a vendored schema under `tests/deploy/schemas/` (see the README there):

    python tests/deploy/vendor_crd_schema.py ray.io_rayclusters.yaml v1 \
        tests/deploy/schemas/raycluster-ray.io-v1.json

The schema is written unchanged (descriptions included); the tests add strictness on load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def crd_version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    """The `openAPIV3Schema` of `version` in a `CustomResourceDefinition` document."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
            return schema
    names = [entry["name"] for entry in crd["spec"]["versions"]]
    raise SystemExit(f"{crd['metadata']['name']} has no version {version!r} (has {names})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="CRD manifest (YAML)")
    parser.add_argument("version", help="CRD version name, e.g. v1")
    parser.add_argument("out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    schema = crd_version_schema(crd, args.version)
    args.out.write_text(json.dumps(schema, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""Validates OpenAPI documents with openapi-spec-validator (0.9), as tests/openapi.rs asks.

Usage: openapi_validate.py FILE...  (JSON or YAML, read as the validator's own reader reads them)

Prints one JSON object: {"results": [{"file", "version", "valid", "errors", "seconds"}]},
with at most five error messages per file. Exits 0 whether or not the documents are valid:
the test judges the results.
"""

import json
import sys
import time

from openapi_spec_validator import OpenAPIV30SpecValidator, OpenAPIV31SpecValidator
from openapi_spec_validator.readers import read_from_filename


def validate(path):
    started = time.monotonic()
    spec, _ = read_from_filename(path)
    version = str(spec.get("openapi", ""))
    validator_class = OpenAPIV31SpecValidator if version.startswith("3.1") else OpenAPIV30SpecValidator
    errors = []
    for error in validator_class(spec).iter_errors():
        errors.append(str(error)[:2000])
        if len(errors) == 5:
            break
    return {
        "file": path,
        "version": version,
        "valid": not errors,
        "errors": errors,
        "seconds": round(time.monotonic() - started, 3),
    }


def main():
    results = [validate(path) for path in sys.argv[1:]]
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()

"""How every benchmark writes its results: one JSON file, its folder created, indented, newline-ended."""

import json
import os


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` as indented JSON (creating the folder)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")

"""The README's command lines, as a test reads them: every line of its ```bash blocks."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_bash_lines(page: str = "README.md") -> list[str]:
    """Every command line of the ```bash blocks of the README (or of another ``page`` of the repository,
    e.g. ``docs/calibration.md``), continuations joined, trailing `  # comments` dropped, each once: the
    quick-start block repeats commands that later sections explain."""
    text = (REPO / page).read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        cur = ""
        for raw in block.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                cur += line[:-1].strip() + " "
                continue
            cur += re.sub(r"\s+#\s.*$", "", line).strip()
            if cur and not cur.startswith("#") and cur not in lines:
                lines.append(cur)
            cur = ""
    return lines


def readme_quantize_command() -> str:
    """The README's main job, ``.venv/bin/foursight quantize ...`` (exactly one such line)."""
    (cmd,) = [c for c in readme_bash_lines() if c.startswith(".venv/bin/foursight quantize")]
    return cmd


#: suffix of the file, beside a cached checkpoint folder, that records the README command which made it
README_COMMAND_FILE = ".made-by"

"""The demo page at ``GET /``: one HTML document with its style and script inline, composed once, at import, from
the files in ``static/demo/`` (their ``README.md`` says what each part does), so no request reads the disk.

``index.html`` names each part on a line of its own, ``@include demo.css``, replaced by that file's text; then
``@REQUEST_SCORE_THRESHOLD@`` is replaced by :data:`REQUEST_SCORE_THRESHOLD`, the page's one templated value.
"""

from __future__ import annotations

import re
from importlib.resources import files

# The lowest score the page asks a detector for: its slider's range starts here. The parity gate's threshold
# (examples/model_repository/digits-detect/1/spec.json) is 0.05 too: below it scores are noise.
REQUEST_SCORE_THRESHOLD = 0.05

ASSETS = files("service.frontend.http") / "static" / "demo"
INCLUDE = re.compile(r"^@include ([\w-]+\.(?:css|html|js))\n", re.MULTILINE)


def compose() -> str:
    """The page: ``index.html`` with each ``@include`` line replaced by its file, and the threshold filled in."""
    index = (ASSETS / "index.html").read_text(encoding="utf-8")
    page = INCLUDE.sub(lambda part: (ASSETS / part[1]).read_text(encoding="utf-8"), index)
    return page.replace("@REQUEST_SCORE_THRESHOLD@", str(REQUEST_SCORE_THRESHOLD))


PAGE = compose()

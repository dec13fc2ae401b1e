"""A source URL's secrets (its user information and every query value, of any characters) in no answer, event, log
line, metric label or failure reason (issue 53): :func:`~service.frontend.sources.urls.mask` over generated URLs,
written raw or percent-encoded; :meth:`SourceUrl.redact` over FFmpeg-like messages naming the URL and its secrets;
and once end to end, a source started over the API against a closed port, failed, and read back every way.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any
from urllib.parse import quote, unquote

from hypothesis import assume, given
from hypothesis import strategies as st

from service.frontend.sources.urls import check_url, mask
from service.inprocess import InProcessServer
from tests.fuzz.conftest import AUTH, FUZZ, NO_SURROGATES, fewer

SCHEMES = st.sampled_from(["rtsp", "rtsps", "http", "https", "RTSP", "Http"])
HOSTS = st.sampled_from(["cam", "127.0.0.1", "cam.example.com", "[::1]", "x-1"])
PORTS = st.sampled_from(["", ":554", ":8080", ":1"])
# Raw text of each part: whatever does not end that part (the authority ends at '/', '?' or '#'; a query value at
# '&' or '#'; a path at '?' or '#').
USERINFO = st.text(st.characters(blacklist_characters="/?#", codec="utf-8"), min_size=1, max_size=12)
NAMES = st.text(st.characters(blacklist_characters="=&#", codec="utf-8"), min_size=1, max_size=8)
VALUES = st.text(st.characters(blacklist_characters="&#", codec="utf-8"), max_size=12)
PATHS = st.text(st.characters(blacklist_characters="?#@", codec="utf-8"), max_size=12).map(lambda p: "/" + p)


@st.composite
def urls(draw: st.DrawFn, *, encoded: bool) -> tuple[str, str, list[str]]:
    """A URL, what mask must show of it (built from its parts, secrets as ``***``), and its secrets. ``encoded``:
    each secret percent-encoded (``quote``, every byte of UTF-8), as check_url admits it; else raw."""
    code: Any = (lambda text: quote(text, safe="")) if encoded else (lambda text: text)
    scheme, host, port, path = draw(SCHEMES), draw(HOSTS), draw(PORTS), draw(PATHS)
    if encoded:
        path = quote(path)
    user = draw(st.none() | USERINFO)
    password = None if user is None else draw(st.none() | USERINFO)
    userinfo = "" if user is None else code(user) + ("" if password is None else ":" + code(password))
    params = draw(st.lists(st.tuples(NAMES, VALUES), max_size=3))
    query = "&".join(f"{code(name)}={code(value)}" for name, value in params)
    url = f"{scheme}://{userinfo}{'@' if userinfo else ''}{host}{port}{path}{'?' if params else ''}{query}"
    shown_query = "&".join(f"{code(name)}=***" for name, _ in params)
    expected = f"{scheme}://{'***@' if userinfo else ''}{host}{port}{path}{'?' if params else ''}{shown_query}"
    secrets = [s for s in (user, password, *(v for _, v in params)) if s]
    return url, expected, secrets


@FUZZ
@given(urls(encoded=False) | urls(encoded=True))
def test_mask_shows_every_part_but_the_secrets(case: tuple[str, str, list[str]]) -> None:
    url, expected, _ = case
    assert mask(url) == expected, url


# FFmpeg-like messages: the URL as given, the target av.open got, a secret alone, the URL percent-decoded.
MESSAGES = ["{url}: Connection refused", "Error opening input {target} ({secret})",
            "{secret}: 401 Unauthorized for {url}", "tried {url} and {decoded}"]  # fmt: skip


@FUZZ
@given(urls(encoded=True), st.sampled_from(MESSAGES))
def test_redact_leaves_no_secret_in_a_message_naming_the_url(case: tuple[str, str, list[str]], template: str) -> None:
    url, expected, secrets = case
    source = check_url(url, source_root=None)
    assert source.shown == expected
    forms = [form for s in secrets for form in (s, quote(s, safe=""))]
    message = template.format(url=url, target=source.target, secret=(forms or ["x"])[-1],
                              decoded=unquote(url))  # fmt: skip
    redacted = source.redact(message)
    skeleton = template.format(url=expected, target=expected, secret="***", decoded="***")
    for form in forms:
        # A secret of fewer than 4 characters is masked only inside the URL (a shorter one would mask an errno's
        # digits), and one that is part of the message's own words cannot be told from them.
        assume(form not in skeleton and "*" not in form)
        if len(form) >= 4:
            assert form not in redacted, (message, redacted)


def _wait_state(client: Any, id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        doc: dict[str, Any] = client.get(f"/v1/sources/{id}", headers=AUTH).json()
        if doc.get("state") in states or time.monotonic() > deadline:
            return doc
        time.sleep(0.02)


# Any characters after a mark: a secret of plain text ("None", "0000") would be found in any answer's own words.
SECRET_TEXT = st.text(st.characters(codec="utf-8", blacklist_categories=NO_SURROGATES), min_size=2, max_size=10).map(
    lambda text: "sEcR" + text
)


@fewer(20)
@given(SECRET_TEXT, SECRET_TEXT, SECRET_TEXT, st.integers(0, 10**6))
def test_a_sources_secrets_are_in_no_answer_event_log_metric_or_reason(
    served: InProcessServer, user: str, password: str, token: str, n: int
) -> None:
    """A source to a closed port (127.0.0.1:9, refused at once) fails; its answers, list, failure reason, results
    events, metrics and log lines show the URL only masked."""
    code = [quote(s, safe="") for s in (user, password, token)]
    url = f"http://{code[0]}:{code[1]}@127.0.0.1:9/cam?fps=5&token={code[2]}"
    shown = "http://***@127.0.0.1:9/cam?fps=***&token=***"
    skeleton = f'{shown} "http" source failed reason Connection refused digits fuzz-url-{n} 127.0.0.1 9'
    secrets = [form for s, c in zip((user, password, token), code, strict=True) for form in (s, c)]
    assume(all(s not in skeleton and "*" not in s for s in secrets))
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    root = logging.getLogger()
    root.addHandler(handler)
    before, root.level = root.level, logging.DEBUG
    id = f"fuzz-url-{n}"
    try:
        with served.client() as client:
            texts = [client.post("/v1/sources", json={"id": id, "url": url, "model": "digits"}, headers=AUTH).text]
            doc = _wait_state(client, id, ("failed",))
            assert doc["state"] == "failed" and doc["url"] == shown, doc
            texts += [str(doc), client.get("/v1/sources", headers=AUTH).text, client.get("/metrics").text]
            texts.append(client.get(f"/v1/sources/{id}/results", headers=AUTH, timeout=10).text)  # its events
            texts.append(client.delete(f"/v1/sources/{id}", headers=AUTH).text)
    finally:
        root.removeHandler(handler)
        root.level = before
    texts.append(logged.getvalue())
    for text in texts:
        for secret in secrets:
            assert secret not in text, (secret, text[:2000])

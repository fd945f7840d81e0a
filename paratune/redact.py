"""Credentials out of what paratune prints and logs.

A database or tracking URL may carry a password in its userinfo
(``postgresql://user:PASSWORD@host/db``) or in its query (``...?password=PASSWORD``, a
``token=`` or ``api_key=``); :func:`redact` masks both wherever they appear in a text, so a
message, an MLflow param or the closing ``mlflow ui`` hint never shows them.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact"]

MASK = "***"

# scheme://user:PASSWORD@ (the user name stays: it is not a secret and helps to tell stores
# apart); a password may hold any character but '@', '/' and white space once encoded
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:?#]*:)(?P<secret>[^\s@/]+)@")
# ?password=..., &token=..., ;api_key=... (libpq, SQLAlchemy and HTTP spellings)
_QUERY = re.compile(
    r"(?P<head>[?&;](?:password|passwd|pwd|pass|sslpassword|secret|client_secret|token"
    r"|access_token|auth_token|api_key|apikey|access_key|secret_key|key)=)"
    r"(?P<secret>[^&;#\s'\"]+)", re.IGNORECASE)


def redact(text: object) -> str:
    """``text`` (made a string) with every password a URL in it carries replaced by ``***``.

    Args:
        text: Any text: a URL, a message holding URLs, a param value.

    Returns:
        The text with the userinfo password and the secret query values of every URL masked.
    """
    text = str(text)
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)

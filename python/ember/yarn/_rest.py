"""Hadoop's REST APIs (the ResourceManager's, a NodeManager's) as a client of
the grid: JSON over HTTP, authenticated as the grid asks.

A grid with simple authentication takes the user as ``user.name``; a
Kerberized one (core-site.xml's ``hadoop.security.authentication=kerberos``)
takes SPNEGO, ``Authorization: Negotiate <token>`` made by libember from the
user's Kerberos ticket or client keytab (:func:`ember._ember.spnego_header`),
and the user is the principal's short name, as Hadoop's default
``auth_to_local`` rule makes it.
"""

from __future__ import annotations

import getpass
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Optional, Tuple

from ember import _ember, hdfs

__all__ = ["GridAuth", "http", "short_name"]


def short_name(principal: str) -> str:
    """``alice@EXAMPLE.COM`` -> ``alice``; ``yarn/host@EXAMPLE.COM`` -> ``yarn``
    (Hadoop's DEFAULT auth_to_local rule for the default realm)."""
    return principal.split("@", 1)[0].split("/", 1)[0]


class GridAuth:
    """How this process authenticates to the grid configured in ``conf_dir``.

    Attributes:
        kerberos: whether the grid is Kerberized.
        user: the Hadoop user this client acts as: the principal's short
            name on a Kerberized grid, else ``HADOOP_USER_NAME`` or the login.
        principal: the Kerberos principal ("" on a simple grid).
    """

    def __init__(self, conf_dir: str) -> None:
        core = hdfs._conf_props(os.path.join(conf_dir, "core-site.xml"))
        self.conf_dir = conf_dir
        self.kerberos = core.get("hadoop.security.authentication", "simple").lower() == "kerberos"
        self.principal = _ember.kerberos_principal() if self.kerberos else ""
        if self.kerberos and not self.principal:
            # no usable ticket or keytab: libember's message says what to do
            _ember.spnego_header("localhost", "the Kerberized grid of " + conf_dir)
        self.user = (short_name(self.principal) if self.kerberos
                     else os.environ.get("HADOOP_USER_NAME") or getpass.getuser())

    def url(self, url: str) -> str:
        """``url`` with ``user.name`` added on a simple grid."""
        if self.kerberos:
            return url
        sep = "&" if "?" in url else "?"
        return url + sep + urllib.parse.urlencode({"user.name": self.user})

    def headers(self, url: str) -> Dict[str, str]:
        """The Authorization header for a request to ``url`` on a Kerberized grid."""
        if not self.kerberos:
            return {}
        host = urllib.parse.urlparse(url).hostname or ""
        return {"Authorization": _ember.spnego_header(host, f"the web service at {host}")}

    def renewer(self) -> str:
        """Who renews the application's delegation tokens: the
        ResourceManager's principal (yarn-site.xml), by its short name."""
        props = hdfs._conf_props(os.path.join(self.conf_dir, "yarn-site.xml"))
        principal = props.get("yarn.resourcemanager.principal", "")
        if not principal:
            raise ValueError(f"{self.conf_dir}/yarn-site.xml has no yarn.resourcemanager.principal"
                             ": a Kerberized grid's client configuration names it")
        return short_name(principal)


def http(method: str, url: str, body: Any = None, timeout: float = 30.0,
         accept: str = "application/json",
         auth: Optional[GridAuth] = None) -> Tuple[int, bytes]:
    """One request; a non-2xx reply raises RuntimeError with the server's
    RemoteException message (or body)."""
    data = json.dumps(body).encode() if body is not None else None
    if auth is not None:
        url = auth.url(url)
    headers = {"Accept": accept, "Content-Type": "application/json"}
    if auth is not None:
        headers.update(auth.headers(url))
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            text = json.loads(text)["RemoteException"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RuntimeError(f"{method} {url.split('?')[0]}: HTTP {e.code}: {text[:2000]}") from None
    except urllib.error.URLError as e:
        raise RuntimeError(f"{method} {url.split('?')[0]}: {e.reason}") from None

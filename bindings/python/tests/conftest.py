"""Fixtures shared by the tests: an HTTPS origin on loopback."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List, Optional, Tuple

import pytest
import trustme


def _origin_handler(seen: List[Optional[str]]) -> type[BaseHTTPRequestHandler]:
    class Origin(BaseHTTPRequestHandler):
        """Answers every GET with a line (``/user``: a JSON user), keeping the authorization
        header it got in ``seen``."""

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            seen.append(self.headers.get("authorization"))
            body = b"hello from the origin\n"
            if self.path == "/user":
                body = b'{"login": "octocat"}\n'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Origin


@pytest.fixture
def origin() -> Iterator[Tuple[int, bytes, List[Optional[str]]]]:
    """An HTTPS origin for ``api.test`` on 127.0.0.1: its port, its CA (PEM), what it saw."""
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("api.test").configure_cert(context)
    seen: List[Optional[str]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _origin_handler(seen))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], ca.cert_pem.bytes(), seen
    finally:
        server.shutdown()
        server.server_close()

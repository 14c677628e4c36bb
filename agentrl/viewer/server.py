"""The local web server of `agentrl view`: one page, its static files, and a small JSON API.

It binds to 127.0.0.1 by default (a port the OS picks unless one is given) and serves:

| path | what |
|---|---|
| `/` | the page (`static/index.html`; its script and style are package data, nothing from the internet) |
| `/api/run` | the run's name, kind, config highlights and its sources (training steps, evaluations) |
| `/api/dashboard` | the dashboard panels with their curves |
| `/api/episodes?source=ID` | `{"episodes": a summary of each episode of a source, "skipped_lines": lines of its file that are not episodes}` |
| `/api/episode?source=ID&index=I` | one whole episode (its trajectory-file line; a training step's with the step's `onpolicy/*` metrics as `onpolicy`) |

Only files under the directory it was given are read, and only through `RunReader`: a request
names a source by id, never by path. The standard library's threading HTTP server is enough for
one person looking at one run; this module starts no process. Answers of more than a few
kilobytes are gzip-compressed when the browser accepts it (an episode with a 2 MB tool output is
a 12 MB line of JSON, about a tenth of that compressed).
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from agentrl.viewer.sources import RunReader

__all__ = ["ViewerServer"]

log = logging.getLogger(__name__)

_COMPRESS_FROM = 2048  # bytes: smaller answers go as they are (gzip's header would outweigh the saving)
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}


def _static(name: str) -> bytes | None:
    root = importlib.resources.files("agentrl.viewer").joinpath("static")
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    item = root.joinpath(name)
    return item.read_bytes() if item.is_file() else None


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def _accepts_gzip(self) -> bool:
        accepted = self.headers.get("Accept-Encoding", "")
        for item in accepted.split(","):
            name, _, params = item.strip().partition(";")
            if name.strip().lower() in ("gzip", "*"):
                return params.replace(" ", "").lower() not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
        return False

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        compress = len(body) >= _COMPRESS_FROM and self._accepts_gzip()
        if compress:
            body = gzip.compress(body, compresslevel=5)  # level 5: most of the saving at a fraction of 9's time
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if compress:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Vary", "Accept-Encoding")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value: object, status: int = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(value, allow_nan=False).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    def do_GET(self) -> None:
        if not self.server.host_allowed(self.headers.get("Host", "")):
            # A page elsewhere that rebinds its own name to 127.0.0.1 must not read the run.
            self._error(HTTPStatus.FORBIDDEN, "this server answers requests for its own address only")
            return
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        reader = self.server.reader
        try:
            if url.path in ("/", "/index.html"):
                body = _static("index.html")
                assert body is not None, "agentrl.viewer is installed without its static files"
                self._send(HTTPStatus.OK, body, _TYPES[".html"])
            elif url.path.startswith("/static/"):
                name = url.path[len("/static/"):]
                body = _static(name)
                if body is None:
                    self._error(HTTPStatus.NOT_FOUND, f"no static file {name}")
                else:
                    self._send(HTTPStatus.OK, body, _TYPES.get(Path(name).suffix, "application/octet-stream"))
            elif url.path == "/api/run":
                self._json(reader.summary())
            elif url.path == "/api/dashboard":
                self._json(reader.dashboard())
            elif url.path == "/api/episodes":
                source = query.get("source", "")
                self._json({"episodes": reader.episodes(source), "skipped_lines": reader.skipped_lines(source)})
            elif url.path == "/api/episode":
                self._json(reader.episode(query.get("source", ""), int(query.get("index", "-1"))))
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no page {url.path}")
        except KeyError as exc:
            self._error(HTTPStatus.NOT_FOUND, f"not found: {exc}")
        except ValueError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away
        except Exception as exc:  # a file that breaks the reader: answer, never drop the connection
            log.exception("agentrl view could not answer %s", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], reader: RunReader) -> None:
        self.reader = reader
        super().__init__(address, _Handler)
        self.loopback = address[0] in ("127.0.0.1", "localhost", "::1")

    def host_allowed(self, host: str) -> bool:
        """On loopback, only requests addressed to loopback names (DNS-rebinding guard)."""
        if not self.loopback:
            return True
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        return name in ("127.0.0.1", "localhost", "[::1]")


class ViewerServer:
    """`agentrl view`'s server over one run, eval directory or trajectory file.

    `ViewerServer(path, port=0)` binds at once (port 0: a free one), `url` says where, and
    `serve_forever()` answers until `shutdown()` (from another thread) or Ctrl-C.
    """

    def __init__(self, path: str | Path, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.reader = RunReader(path)
        self._server = _Server((host, port), self.reader)
        address = self._server.server_address
        self.host, self.port = str(address[0]), int(address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def serve_forever(self) -> None:
        try:
            self._server.serve_forever()
        finally:
            self._server.server_close()

    def start(self) -> threading.Thread:
        """Serve from a daemon thread (tests, notebooks); `shutdown()` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="agentrl-view", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        self._server.shutdown()

"""Test helpers for the limits on image references: a PNG that declares any size in a few bytes, and a
local HTTP server (127.0.0.1, a thread of the test process) whose paths serve an image's bytes, an error
status, an endless body or a trickle."""
import http.server
import struct
import threading
import zlib
from contextlib import contextmanager


def declared_png(width: int, height: int) -> bytes:
    """A greyscale PNG whose header declares `width` x `height` pixels, followed by one row of pixel data
    (enough for a reader that checks the size before decoding)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(1 + width)))
            + chunk(b"IEND", b""))

FOREVER = "forever"  # 200 without a length, then zeros until the client hangs up


def redirect(to: str) -> tuple:
    """A route that answers 302 with `Location: to`."""
    return ("redirect", to)


def trickle(seconds: float) -> tuple:
    """A route that sends the headers of a 1 MB body, then one byte every `seconds`."""
    return ("trickle", seconds)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        route, stop = self.server.routes.get(self.path, 404), self.server.stop
        self.server.hits[self.path] = self.server.hits.get(self.path, 0) + 1
        try:
            if isinstance(route, tuple) and route[0] == "redirect":
                self.send_response(302)
                self.send_header("Location", route[1])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif isinstance(route, int):
                self.send_error(route)
            elif isinstance(route, bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(route)))
                self.end_headers()
                self.wfile.write(route)
            elif route == FOREVER:
                self.send_response(200)
                self.end_headers()
                while not stop.is_set():
                    self.wfile.write(bytes(1 << 16))
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(10**6))
                self.end_headers()
                while not stop.is_set():
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    stop.wait(route[1])
        except OSError:  # the client hung up
            pass


@contextmanager
def image_server(routes: dict, hits: dict | None = None):
    """Serve `routes` ({path: bytes (200 with that body) | status code | FOREVER | trickle(s) |
    redirect(to)}); yields the base URL. Other paths are 404. `hits` (a dict, when given) counts the
    requests per path."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.routes, server.stop, server.hits = routes, threading.Event(), {} if hits is None else hits
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()

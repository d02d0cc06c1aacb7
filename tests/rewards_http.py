"""Test helpers: a free 127.0.0.1 port, build_app(source) served by uvicorn in a thread, raw sockets."""
import socket
import threading
import time
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def in_thread_server(source, token=None):
    """build_app(source) served by uvicorn in a thread of this process, on a free 127.0.0.1 port."""
    import uvicorn

    from posttrain.rewards.server import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(source, token=token), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "in-thread server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def raw(base, data: bytes, close: bool = False) -> socket.socket:
    """A connection to `base` (http://host:port) that has sent `data`; closed at once when `close`."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(data)
    if close:
        sock.close()
    return sock


def read_until_closed(sock, limit_s: float) -> bytes:
    """What the server sends until it closes the connection; socket.timeout when it keeps it open."""
    sock.settimeout(limit_s)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    sock.close()
    return got

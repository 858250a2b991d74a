"""What the engines' server tests share: a free port, waiting for a server's health, and a JSON request."""

import json
import socket
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server, port, log_path, seconds):
    """Polls `/health` until the server answers; fails with the end of its log if it exits or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        assert server.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"the server did not start in {seconds} s"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)


def post(port, path, body, timeout=300):
    """POSTs `body` as JSON to the local server and returns its JSON answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=timeout).read())

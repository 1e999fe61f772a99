"""A local Hugging Face Hub endpoint for the tests of what asyncrl uploads (tests/test_hub_push.py,
tests/trainer/test_completions_hub.py): it records the repositories created and each commit's files, and can refuse
or answer slowly."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from huggingface_hub import constants

USER = "me"
"""The token's user: the namespace of a repository named without one."""


@dataclass
class Commit:
    path: str
    """The request's path: /api/models/OWNER/NAME/commit/main, or /api/datasets/... for a dataset."""
    summary: str
    files: dict[str, bytes]


@dataclass
class FakeHub:
    """The Hub's endpoints that HfApi.create_repo, upload_folder and create_commit call; every file arrives inline
    (the preupload answer makes each a regular, not an LFS, upload)."""

    endpoint: str = ""
    created: list[dict[str, Any]] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    fail_with: int | None = None
    """Answer creations and commits with this HTTP status: 403 as the Hub answers a token that may not write there,
    500 a Hub in trouble."""
    refused: int = 0
    """Requests answered with ``fail_with``."""
    delay_s: float = 0.0
    """Answer each commit this late: a slow Hub."""


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if hub.fail_with and (self.path == "/api/repos/create" or "/commit/" in self.path):
                hub.refused += 1
                return self._answer({"error": "You don't have the rights to create a repo here"}, hub.fail_with)
            if self.path == "/api/repos/create":
                request = json.loads(body)
                hub.created.append(request)
                kind, owner = "datasets/" if request.get("type") == "dataset" else "", request["organization"] or USER
                return self._answer({"url": f"{hub.endpoint}/{kind}{owner}/{request['name']}"})
            if self.path == "/api/validate-yaml":
                return self._answer({"errors": [], "warnings": []})
            if "/preupload/" in self.path:
                files = json.loads(body)["files"]
                return self._answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})  # fmt: skip
            time.sleep(hub.delay_s)
            lines = [json.loads(line) for line in body.decode().splitlines()]
            files = {op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in lines[1:]}
            hub.commits.append(Commit(self.path, lines[0]["value"]["summary"], files))
            repo = self.path.split("/commit/")[0].removeprefix("/api/").removeprefix("models/")  # datasets/ stays
            return self._answer({"commitUrl": f"{hub.endpoint}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})

        def _answer(self, payload: dict[str, Any], status: int = 200) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serving_fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """HfApi pointed at a local endpoint, with a token and online."""
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.endpoint = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    yield fake
    server.shutdown()
    thread.join()

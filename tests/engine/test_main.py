"""``python -m asyncrl.engine``: what it refuses before the model loads, in one line."""

import socket

import pytest

from asyncrl.engine.__main__ import main


def test_a_port_already_in_use_is_refused_before_the_model_loads(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["--model", str(tmp_path / "never-loaded"), "--port", str(port)])
    assert str(exit_.value) == (
        f"--port {port}: 127.0.0.1:{port} is already in use (another server?); choose a free one with --port N"
    )

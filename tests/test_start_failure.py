"""A start that fails (Ray's processes too slow on a loaded machine, say) ends in one line on stderr and exit
status 1, not a traceback, and takes the public server down with it. No Ray is started: connect is made to fail."""
import gc

import yaml

from router import cli, launch


def test_failed_start_is_one_line_and_frees_the_public_server(tmp_path, monkeypatch, capsys):
    def slow_ray(config, quiet=False):
        raise Exception("The current node timed out during startup.\nThis could happen because ...")
    monkeypatch.setattr(launch, "connect", slow_ray)
    path = tmp_path / "specpool.yaml"
    path.write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "port": 0, "admin_port": 0}}))
    assert cli.main(["demo", "--config", str(path), "hello"]) == 1
    gc.collect()                                    # a server left running would complain here, its loop closed
    err = capsys.readouterr().err
    assert err.strip() == "specpool: could not start: Exception: The current node timed out during startup."


def test_a_failed_start_with_the_http_api_on_is_one_line_too(tmp_path, monkeypatch, capfd):
    """The HTTP server stopped with no grace logged uvicorn's 'ERROR: Cancel 0 running task(s), timeout graceful
    shutdown exceeded' before the line."""
    def slow_ray(config, quiet=False):
        raise Exception("The current node timed out during startup.")
    monkeypatch.setattr(launch, "connect", slow_ray)
    path = tmp_path / "specpool.yaml"
    path.write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "port": 0, "admin_port": 0},
                                    "http": {"port": 0}}))
    assert cli.main(["serve", "--config", str(path)]) == 1
    gc.collect()
    captured = capfd.readouterr()
    assert captured.err.strip() == "specpool: could not start: Exception: The current node timed out during startup."

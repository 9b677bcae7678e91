"""The CLI as a new user meets it: argument errors are one line naming the option, the admin commands
find the server through --config, serve takes --port / --http-port, and the prompt can come from stdin or a
file. (Generating through a running server is in tests/test_openai_http.py.)"""
import io

import pytest
import yaml

from router import cli


@pytest.mark.parametrize("argv, option", [
    (["generate", "--k", "-1", "x"], "--k"), (["generate", "--seed", "-1", "x"], "--seed"),
    (["generate", "--max-new-tokens", "-5", "x"], "--max-new-tokens"), (["generate", "--top-k", "x", "y"], "--top-k"),
    (["generate", "--seed", str(2 ** 64), "x"], "--seed"), (["serve", "--config", "c", "--port", "-3"], "--port"),
    (["demo", "--max-new-tokens", "0", "x"], "--max-new-tokens"),
])
def test_argument_errors_are_one_line_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"argument {option}: must be" in err
    assert "Traceback" not in err


def test_prompt_from_stdin_file_or_argument(tmp_path, monkeypatch):
    parser, commands = cli.build_parser()
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin("))
    args = parser.parse_args(["generate", "-"])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == "from stdin("
    (tmp_path / "p.txt").write_text("from a file(")
    args = parser.parse_args(["generate", "--prompt-file", str(tmp_path / "p.txt")])
    cli.read_prompt(commands["generate"], args)
    assert args.prompt == "from a file("
    for argv in (["generate"], ["generate", "x", "--prompt-file", str(tmp_path / "p.txt")],
                 ["generate", "--prompt-file", str(tmp_path / "missing.txt")]):
        with pytest.raises(SystemExit):
            cli.read_prompt(commands["generate"], parser.parse_args(argv))


def test_admin_address_comes_from_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"router": {"host": "0.0.0.0", "port": 50123}}))
    parser, _ = cli.build_parser()
    assert cli.admin_address(parser.parse_args(["status", "--config", str(path)])) == "127.0.0.1:50123"
    assert cli.admin_address(parser.parse_args(["reload", "--config", str(path)])) == "127.0.0.1:50123"
    assert cli.admin_address(parser.parse_args(["reload", "--config", str(path), "--address", "h:1"])) == "h:1"
    assert cli.admin_address(parser.parse_args(["status"])) == cli.DEFAULT_ADDRESS


def test_serve_ports_override_the_config():
    from settings.schema import config_from_dict
    config = cli.with_ports(config_from_dict({}), 50999, 8123)
    assert (config.router.port, config.http.port) == (50999, 8123)
    assert cli.with_ports(config, None, None) == config


def test_demo_serves_on_any_free_port_so_a_running_serve_does_not_stop_it(monkeypatch):
    import argparse

    from settings.schema import config_from_dict
    seen = {}

    async def demo(config, args):
        seen["ports"] = (config.router.port, config.http.port)
        return 0
    monkeypatch.setattr(cli, "_demo", demo)
    config = config_from_dict({"router": {"port": 50051}, "http": {"port": 8000}})
    assert cli.run_server(argparse.Namespace(command="demo"), config) == 0
    assert seen["ports"] == (0, -1)

"""A busy router.metrics_port fails the start at once, in one line naming the key and the port, before Ray starts
(so nothing is left behind: Ray is made to fail the test if it is reached)."""
import gc

import yaml

from router import cli, launch


def test_a_busy_metrics_port_fails_at_once_naming_the_key_and_the_port(tmp_path, monkeypatch, capsys):
    """router.metrics_port is bound with the public ports, before Ray starts: a busy one fails the start at once
    (it failed after Ray had started and the pools had loaded, with 'OSError: [Errno 98] Address already in use',
    and left Ray's agents running)."""
    import socket

    def no_ray(config, quiet=False):
        raise AssertionError("Ray was started before the metrics port was bound")
    monkeypatch.setattr(launch, "connect", no_ray)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "specpool.yaml"
        path.write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "port": 0, "metrics_port": port}}))
        assert cli.main(["serve", "--config", str(path)]) == 1
    gc.collect()
    err = capsys.readouterr().err
    assert err.strip() == (f"specpool: could not start: MetricsPortBusy: router.metrics_port = {port}: cannot listen "
                           f"on 127.0.0.1:{port}: Address already in use")

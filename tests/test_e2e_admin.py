"""Operator control through the real service: hot reload changes the K in use without dropping an
in-flight request, an invalid reload is refused and the old K stays, the ports serve was started with
stay over every reloaded file, metrics move as requests run, and the admin commands work from a copied config.

The module's service is started from a YAML file whose model paths are relative to the file's folder,
as deploy/local.yaml's are, so every reload here resolves them against that folder (ReloadRequest.config_dir);
the README's `specpool reload --config FILE` and SIGHUP (re-read the file) are both accepted."""
import dataclasses
import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from settings.schema import load_config
from tests.conftest import service_config

PROMPT = [9, 8, 7, 6]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, byte_pair) -> Path:
    """specpool.yaml next to a copy of the byte pair, naming it by paths relative to the YAML's folder."""
    folder = tmp_path_factory.mktemp("admin-deploy")
    shutil.copytree(Path(byte_pair[0]).parent, folder / "pair")
    path = folder / "specpool.yaml"
    write_config(path, service_config(("pair/draft", "pair/target"), router={"metrics_port": 0},
                                      speculation={"policy": "fixed", "k": 1, "warmup_rounds": 2}))
    return path


def write_config(path: Path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def config(config_file) -> dict:
    """The YAML document as written (relative model paths)."""
    return yaml.safe_load(config_file.read_text())


@pytest.fixture(scope="module")
def service(start_service, config_file):
    loaded = load_config(config_file)             # as `specpool serve --config FILE` loads it
    assert Path(loaded.draft.model).is_absolute() and Path(loaded.target.model).is_absolute()
    return start_service(dataclasses.asdict(loaded))


@pytest.fixture(scope="module")
def admin(service):
    channel = grpc.insecure_channel(service.admin_address)
    yield admin_pb2_grpc.AdminStub(channel)
    channel.close()


def with_speculation(config: dict, **speculation) -> dict:
    return {**config, "speculation": {**config["speculation"], **speculation}}


def reload(admin, config, config_file, **speculation):
    return admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(with_speculation(config, **speculation)),
                                                config_dir=str(config_file.parent)))


def current_k(admin) -> int:
    return yaml.safe_load(admin.GetStatus(admin_pb2.GetStatusRequest()).config_yaml)["speculation"]["k"]


def scrape(service) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.service.metrics_port}/metrics").read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def assert_k_in_force(service, admin, k: int) -> None:
    """The config's K, the pool controller's K (Admin.GetStatus) and the specpool_spec_decode_k gauge agree
    (the module's policy is fixed, so the pool's K is the config's)."""
    status = admin.GetStatus(admin_pb2.GetStatusRequest())
    assert yaml.safe_load(status.config_yaml)["speculation"]["k"] == k
    stats = json.loads(status.stats_json)
    assert stats["pool"]["k"] == k and stats["k"] == k and stats["k_from"].startswith(("pool ", "request "))
    assert scrape(service)["specpool_spec_decode_k"] == k


def first_round_k(service) -> int:
    """The K the router's policy gives a new request's first drafting round (its second: the first is the target's
    prefill alone, speculation.prefill_first)."""
    response = service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8))
    return response.stats.k_per_round[1]


def test_hot_reload_changes_k_of_an_in_flight_request(service, admin, config, config_file, reference_generate):
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=300)
    chunks, started = [], threading.Event()

    def consume():
        for chunk in service.stub.GenerateStream(request):
            chunks.append(chunk)
            if len(chunks) == 20:
                started.set()
    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(60)
    reload(admin, config, config_file, k=4)
    thread.join(120)
    try:
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference_generate(PROMPT, 300)             # nothing dropped, nothing changed
        ks = list(chunks[-1].stats.k_per_round)
        assert ks[:2] == [0, 1] and 4 in ks and ks.index(4) >= 20    # K moved mid-request (round 1: the prefill)
        assert_k_in_force(service, admin, 4)
    finally:
        reload(admin, config, config_file, k=1)


def test_invalid_reload_is_refused_and_old_k_stays(service, admin, config, config_file):
    with pytest.raises(grpc.RpcError) as info:
        reload(admin, config, config_file, k_min=5, k_max=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("speculation.k_max:")
    with pytest.raises(grpc.RpcError) as info:
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump({**config, "draft": {"replicas": 3}})))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert_k_in_force(service, admin, 1)


def test_metrics_counters_move(service, admin):
    before = scrape(service)
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=16)
    request.speculation.k = 3
    response = service.stub.Generate(request)
    with pytest.raises(grpc.RpcError):
        service.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=0))
    after, deadline = scrape(service), time.monotonic() + 10

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    # Each request is counted as its handler ends, just after its client sees the status.
    while time.monotonic() < deadline and (delta('specpool_requests_total{code="OK"}') < 1 or
                                           delta('specpool_requests_total{code="INVALID_ARGUMENT"}') < 1):
        time.sleep(0.05)
        after = scrape(service)
    stats = response.stats
    assert delta("specpool_spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert delta("specpool_spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert delta("specpool_spec_decode_num_drafts_total") == sum(1 for k in stats.k_per_round if k)
    assert delta('specpool_requests_total{code="OK"}') == 1
    assert delta('specpool_requests_total{code="INVALID_ARGUMENT"}') == 1
    assert delta("specpool_time_to_first_token_seconds_count") == 1
    assert delta("specpool_e2e_request_latency_seconds_count") == 1
    # The gauge is the pool policy's K (fixed at 1 here), not the K a request asked for (3).
    assert 3 in stats.k_per_round and after["specpool_spec_decode_k"] == 1
    assert_k_in_force(service, admin, 1)


def test_readme_reload_command_and_sighup_accept_relative_model_paths(service, admin, config, config_file,
                                                                        monkeypatch, capsys):
    """`specpool reload --config FILE` (README) and SIGHUP re-read the file serve was started from, whose
    model paths are relative to its folder: both apply its new speculation section. (They were refused
    with 'draft.model: changing this needs a restart' while the file's folder was not sent.)"""
    from router.cli import main
    from router.service import reload_from_file
    original = config_file.read_text()
    name = config_file.name
    # Without its folder, and from a working directory without pair/, the same document names other models
    # ("pair/draft" is taken as a hub ID): refused, K kept.
    with pytest.raises(grpc.RpcError) as info:
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(with_speculation(config, k=3))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("draft.model:")
    assert_k_in_force(service, admin, 1)
    monkeypatch.chdir(config_file.parent)             # relative --config, as in the README
    try:
        write_config(config_file, with_speculation(config, k=3))
        capsys.readouterr()
        assert main(["reload", "--config", name, "--address", service.admin_address]) == 0
        assert "k: 3" in capsys.readouterr().out
        assert_k_in_force(service, admin, 3)
        assert first_round_k(service) == 3

        write_config(config_file, with_speculation(config, k=2))
        service._run(reload_from_file(service.service, name))      # what `kill -HUP <serve pid>` runs
        out = capsys.readouterr().out
        assert f"reloaded {name}" in out and "refused" not in out, out
        assert_k_in_force(service, admin, 2)
        assert first_round_k(service) == 2
    finally:
        config_file.write_text(original)
        reload(admin, config, config_file, k=1)
    assert_k_in_force(service, admin, 1)


def test_an_empty_reload_is_refused_as_empty(service, admin):
    """An empty config_yaml (or one of comments only) is almost surely a mistake: INVALID_ARGUMENT saying so
    (it was refused as FAILED_PRECONDITION 'router.port: changing this needs a restart')."""
    for text in ("", "\n", "# nothing here\n"):
        with pytest.raises(grpc.RpcError) as info:
            admin.Reload(admin_pb2.ReloadRequest(config_yaml=text))
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "config_yaml: empty")
    assert_k_in_force(service, admin, 1)


def test_a_reload_with_a_key_given_twice_is_refused_naming_it_and_its_lines(service, admin):
    """Admin.Reload reads its document as config files are read: a duplicate key is INVALID_ARGUMENT naming it
    (yaml.safe_load kept the last one silently), and the running K stays."""
    with pytest.raises(grpc.RpcError) as info:
        admin.Reload(admin_pb2.ReloadRequest(config_yaml="speculation:\n  k: 2\n  k: 3\n"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config_yaml, line 3: duplicate key speculation.k (first on line 2)" in info.value.details()
    assert_k_in_force(service, admin, 1)


def test_reloads_keep_the_ports_serve_was_started_with(service, admin, config, config_file, monkeypatch, capsys):
    """`serve --port P --http-port H` win over the file at every reload, not only at start: a file that differs
    from the running config only in router.port / http.port reloads, through Admin.Reload and SIGHUP, and the
    running ports stay; one that changes another restart-only key is still refused. (Both reloads were refused
    with 'router.port: changing this needs a restart': the file was re-read without the command line's ports.)"""
    from router.service import reload_from_file
    router = service.service.router
    running = {"router": {"port": router.config.router.port}, "http": {"port": router.config.http.port}}
    monkeypatch.setattr(router, "overrides", running)      # what Service(..., overrides=) hands the Router
    in_file = {**config, "router": {**config["router"], "port": 50071}, "http": {"port": 8071}}
    sighup_file = config_file.parent / "ports.yaml"       # beside the models, like the file serve was started with
    try:
        reload(admin, in_file, config_file, k=2)
        assert_k_in_force(service, admin, 2)
        write_config(sighup_file, with_speculation(in_file, k=3))
        capsys.readouterr()
        service._run(reload_from_file(service.service, str(sighup_file)))
        assert "refused" not in capsys.readouterr().out
        assert_k_in_force(service, admin, 3)
        status = yaml.safe_load(admin.GetStatus(admin_pb2.GetStatusRequest()).config_yaml)
        assert {section: {"port": status[section]["port"]} for section in running} == running
        with pytest.raises(grpc.RpcError) as info:
            reload(admin, {**in_file, "ray": {**config["ray"], "namespace": "elsewhere"}}, config_file, k=4)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith("ray.namespace:")
        assert_k_in_force(service, admin, 3)
    finally:
        sighup_file.unlink(missing_ok=True)
        reload(admin, config, config_file, k=1)


def test_admin_commands_with_a_copied_config_reach_the_server_which_checks_it(service, admin, config, tmp_path,
                                                                               capsys):
    """`status` / `reload --config` with a copy of the config away from its model folders (port edited) reach the
    server: the client reads only the address from it (it said 'config error: draft.model: no model folder').
    What reload sends is the server's to check: it names the model folder it cannot find."""
    from router.cli import main
    copied = tmp_path / "x" / "my.yaml"
    copied.parent.mkdir()
    write_config(copied, {**config, "router": {**config["router"], "admin_port": service.service.admin_port},
                          "draft": {**config["draft"], "model": "models/pair/draft"},
                          "target": {**config["target"], "model": "models/pair/target"}})
    capsys.readouterr()
    assert main(["status", "--config", str(copied)]) == 0
    assert main(["reload", "--config", str(copied)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: draft.model: no model folder 'models/pair/draft' (tried "), err
    assert_k_in_force(service, admin, 1)


def test_admin_answers_on_its_own_port_and_not_on_the_public_one(service, admin, capsys):
    """Admin (Reload, GetStatus) has no credentials of its own beyond the port's TLS: it answers on
    router.admin_host:admin_port (loopback by default), and the public port, which clients reach, answers it
    UNIMPLEMENTED (any client of the public port could reload the config). The admin port serves no generation."""
    assert service.service.admin_port not in (0, service.service.port)
    assert json.loads(admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30).stats_json)["pool"]["k"] == 1
    with grpc.insecure_channel(service.address) as public:
        for call, request in (("GetStatus", admin_pb2.GetStatusRequest()),
                              ("Reload", admin_pb2.ReloadRequest(config_yaml="speculation: {k: 2}\n"))):
            with pytest.raises(grpc.RpcError) as info:
                getattr(admin_pb2_grpc.AdminStub(public), call)(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, call
    with grpc.insecure_channel(service.admin_address) as private:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(private).Generate(
                generation_pb2.GenerateRequest(prompt="x", max_new_tokens=1), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    from router.cli import main
    capsys.readouterr()
    assert main(["status", "--address", service.address]) == 1           # the public port: says where Admin is
    assert capsys.readouterr().err == (f"error: UNIMPLEMENTED: Method not found! (no Admin service at "
                                       f"{service.address}: it listens on router.admin_host:admin_port, "
                                       f"127.0.0.1:50052 by default, not on the public port)\n")
    assert_k_in_force(service, admin, 1)


def test_status_prints_a_summary_and_the_whole_on_asking(service, capsys):
    """`specpool status` prints a summary of a dozen lines (it printed ~500: the config, then every controller's
    statistics); --full prints those, the statistics indented, not one long line (Admin.GetStatus's stats_json
    stays compact); --json the statistics alone, for jq."""
    from router.cli import main
    capsys.readouterr()
    assert main(["status", "--address", service.admin_address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SERVING: 1 of 1 target replica(s) ready; ") and len(lines) < 15, lines
    assert lines[1].startswith("adaptive K 1, last chosen by ")
    assert "draft.method model, draft_sampling greedy" in lines[1]
    assert main(["status", "--address", service.admin_address, "--full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("router:\n")
    stats = out[out.index("\n{\n") + 1:]
    assert json.loads(stats)["pool"]["k"] == 1
    assert '\n  "pool": {\n    "' in stats and max(map(len, stats.splitlines())) < 200
    assert main(["status", "--address", service.admin_address, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone.keys() == json.loads(stats).keys() and alone["pool"]["k"] == 1


def test_admin_reload_leaves_one_line_in_serves_log_saying_what_changed_or_why_it_was_refused(service, admin, config,
                                                                                             config_file, capsys):
    """Admin.Reload (`specpool reload`) left no trace in serve's log; SIGHUP logged a 600-character dataclass dump.
    Both now log what changed, and a refusal its reason."""
    capsys.readouterr()
    try:
        assert list(reload(admin, config, config_file, k=2).changes) == ["speculation.k 1 -> 2"]  # told the client
        assert list(reload(admin, config, config_file, k=2).changes) == []                         # too
        with pytest.raises(grpc.RpcError):
            reload(admin, {**config, "ray": {**config["ray"], "namespace": "elsewhere"}}, config_file, k=2)
        lines = [line.split("[specpool] ", 1)[1] for line in capsys.readouterr().out.splitlines()
                 if "reload" in line]
    finally:
        reload(admin, config, config_file, k=1)
    assert lines == ["reloaded by Admin.Reload (specpool reload): speculation.k 1 -> 2",
                     "reloaded by Admin.Reload (specpool reload): no change",
                     "reload by Admin.Reload (specpool reload) refused, running config kept: ray.namespace: changing "
                     "this needs a restart (running 'specpool', this document 'elsewhere')"]


def test_admin_keys_turned_on_rotated_and_off_by_reload_and_sent_by_the_admin_commands(service, admin, config,
                                                                                        config_file, tmp_path,
                                                                                        monkeypatch, capsys):
    """router.admin_keys (hot-reloadable): once a reload sets them, an Admin call without one of them is
    UNAUTHENTICATED; `specpool status` sends $SPECPOOL_ADMIN_KEY, else the first of --config's keys; GetStatus shows
    them redacted; a reload rotates them (the old key refused at once) and one without them turns the check off.
    Generation needs no key."""
    from router.bearer import ADMIN_KEY_ENV, ADMIN_REFUSED
    from router.cli import main

    def keyed(key):
        return (("authorization", f"Bearer {key}"),)

    def with_keys(keys):
        return {**config, "router": {**config["router"], "admin_keys": keys}}
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    reload(admin, with_keys(["first-key"]), config_file, k=1)
    try:
        for metadata in (None, keyed("wrong")):
            with pytest.raises(grpc.RpcError) as info:
                admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=metadata, timeout=30)
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, ADMIN_REFUSED)
        status = yaml.safe_load(admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=keyed("first-key"),
                                                timeout=30).config_yaml)
        assert status["router"]["admin_keys"] == "<redacted>"
        capsys.readouterr()
        assert main(["status", "--address", service.admin_address]) == 1
        assert capsys.readouterr().err == f"error: UNAUTHENTICATED: {ADMIN_REFUSED}\n"
        copied = tmp_path / "with-key.yaml"
        write_config(copied, {**with_keys(["first-key"]), "router": {**with_keys(["first-key"])["router"],
                                                                     "admin_port": service.service.admin_port}})
        assert main(["status", "--config", str(copied)]) == 0
        monkeypatch.setenv(ADMIN_KEY_ENV, "first-key")
        assert main(["status", "--address", service.admin_address]) == 0
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(with_keys(["second-key"])),
                                             config_dir=str(config_file.parent)), metadata=keyed("first-key"))
        with pytest.raises(grpc.RpcError) as info:
            admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=keyed("first-key"), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert first_round_k(service) == 1                                  # generation needs no key
        admin.Reload(admin_pb2.ReloadRequest(config_yaml=yaml.safe_dump(config), config_dir=str(config_file.parent)),
                     metadata=keyed("second-key"))
    finally:
        if service.service.router.config.router.admin_keys:                  # a failed step leaves no key behind
            service.service.router.config = dataclasses.replace(
                service.service.router.config,
                router=dataclasses.replace(service.service.router.config.router, admin_keys=[]))
    assert_k_in_force(service, admin, 1)                                     # no key needed again

"""Admin's bearer keys (router.admin_keys, router/bearer.py), before the pools load: a call without one of them is
UNAUTHENTICATED, on Admin's own port and on the public port alike (router.admin_port -1), while the loading message
(UNAVAILABLE) goes only to a call that carries one; with no keys, any call gets it. The running service's keys
(reload, rotation, the admin commands) are tested in tests/test_e2e_admin.py."""
import asyncio

import grpc
import pytest

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc
from router.bearer import ADMIN_REFUSED, allowed, metadata_authorization


def test_a_key_is_allowed_only_as_bearer_of_one_of_the_keys():
    assert allowed([], None) and allowed([], "Bearer anything")
    assert allowed(["k1", "k2"], "Bearer k2")
    for given in (None, "", "k2", "Bearer k3", "Bearer k2 ", "bearer k2", "Bearer k"):
        assert not allowed(["k1", "k2"], given), given
    assert metadata_authorization((("x-other", "1"), ("authorization", "Bearer k"))) == "Bearer k"
    assert metadata_authorization(None) is None


@pytest.mark.parametrize("keys", [[], ["s3cret"]], ids=["no keys", "keys"])
def test_admin_refuses_a_call_without_a_key_before_saying_it_is_loading(keys):
    from router.server import start_admin_server, start_public_server

    async def codes() -> list:
        server, port, servicer, _ = await start_public_server("127.0.0.1", 0, with_admin=True, admin_keys=keys)
        admin, admin_port = await start_admin_server(servicer, "127.0.0.1", 0, admin_keys=keys)
        got = []
        try:
            for bound in (port, admin_port):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{bound}") as channel:
                    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", "Bearer s3cret"),)):
                        try:
                            await admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(),
                                                                              metadata=metadata, timeout=10)
                        except grpc.aio.AioRpcError as exc:
                            got.append((exc.code(), exc.details() if exc.code() != grpc.StatusCode.UNAVAILABLE
                                        else "loading"))
        finally:
            await asyncio.gather(server.stop(0), admin.stop(0))
        return got
    loading = (grpc.StatusCode.UNAVAILABLE, "loading")
    refused = (grpc.StatusCode.UNAUTHENTICATED, ADMIN_REFUSED)
    assert asyncio.run(codes()) == ([refused, refused, loading] if keys else [loading] * 3) * 2

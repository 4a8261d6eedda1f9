"""Stored adapters served by profiles: the catalog's rules, the files each engine needs, the
node's copies (received in pieces, verified, put in place whole), the supervisor handing them to
the engine, and the server delivering them over a real link to a real agent link."""

from __future__ import annotations

import base64
import hashlib
import os
import pwd
import random
import stat
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.adapters import AdapterCache, NotDelivered, copy_name, manifest_digest
from llmgw.agent.link import AgentLink
from llmgw.core.catalog import (
    AdapterUnavailable,
    Model,
    Profile,
    StoredAdapter,
    stored_adapter_problems,
    validate_profile,
    with_stored_files,
)
from llmgw.core.engines import EngineBinaries, build_plan, validate
from llmgw.core.shard import Adapter, ShardSpec
from llmgw.core.training import FileDigest
from llmgw.server.adapters import AdapterDelivery, DeliveryFailed
from llmgw.server.replicas import ReplicaManager
from llmgw.wire.messages import AdapterPiece
from llmgw.wire.pieces import PIECE_BYTES
from tests.agent import test_supervisor
from tests.agent.test_supervisor import FAILED, READY, Lab, free_port, start_agent
from tests.helpers import fake_inventory, start_link_server, wait_for

lab = test_supervisor.lab  # the supervisor tests' fixture: a work dir and fake engine binaries

MODELS = {
    "m": Model(name="m", path="/models/m.gguf", format="gguf"),
    "hf": Model(name="hf", path="org/hf", format="safetensors"),
}


def digest(name: str, data: bytes) -> FileDigest:
    return FileDigest(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())


FILES = {
    "adapter_model.safetensors": b"s" * 1000,
    "adapter_config.json": b'{"r": 8}',
    "adapter.gguf": bytes(random.Random(7).getrandbits(8) for _ in range(PIECE_BYTES + 1234)),
}
DIGESTS = {name: digest(name, data) for name, data in FILES.items()}
STORED = {
    "qa": StoredAdapter(name="qa", model="m", files=tuple(DIGESTS.values())),
    "peft-only": StoredAdapter(
        name="peft-only",
        model="hf",
        files=(DIGESTS["adapter_model.safetensors"], DIGESTS["adapter_config.json"]),
    ),
}


def llama_profile(*adapters: Adapter, **changes: object) -> Profile:
    fields = {
        "name": "p1",
        "model": "m",
        "engine": "llamacpp",
        "gpu_class": None,
        "memory_mib": 256,
        "adapters": adapters,
        **changes,
    }
    return Profile(**fields)


def spec_of(*adapters: Adapter, engine: str = "llamacpp", model: str = "m") -> ShardSpec:
    return ShardSpec(
        shard_id="s1",
        replica_id="r1",
        model=model,
        model_path="/models/m.gguf",
        engine=engine,
        port=20000,
        adapters=adapters,
    )


# --- the catalog's rules (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapter", "problem"),
    [
        (Adapter(name="a"), "profiles.p1.adapters[0].path: set path (files on the node) or source"),
        (Adapter(name="a", path="/x", source="qa"), "profiles.p1.adapters[0]: set path"),
        (Adapter(name="a", source="Q A"), "profiles.p1.adapters[0].source: 'Q A' is not an adapter name"),
        (Adapter(name="", source="qa"), "profiles.p1.adapters[0].name: empty"),
        (
            Adapter(name="a", source="qa", files=(DIGESTS["adapter.gguf"],)),
            "profiles.p1.adapters[0].files: set by the server",
        ),
    ],
)
def test_an_adapter_is_a_path_or_a_stored_source_and_its_mistakes_are_named(adapter, problem):
    problems = validate_profile(llama_profile(adapter), MODELS)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_path_and_source_adapters_are_both_valid_and_names_are_unique():
    profile = llama_profile(Adapter(name="a", path="/x.gguf"), Adapter(name="b", source="qa"))
    assert validate_profile(profile, MODELS) == []
    twice = llama_profile(Adapter(name="a", path="/x.gguf"), Adapter(name="a", source="qa"))
    assert validate_profile(twice, MODELS) == ["profiles.p1.adapters[1].name: 'a' is given twice"]


def test_a_source_must_be_a_stored_adapter_of_the_model_with_the_engines_files():
    ok = llama_profile(Adapter(name="a", source="qa"))
    assert stored_adapter_problems(ok, STORED) == []
    assert stored_adapter_problems(llama_profile(Adapter(name="a", source="x")), STORED) == [
        "profiles.p1.adapters[0].source: no stored adapter 'x' of model 'm'"
    ]
    other_model = llama_profile(Adapter(name="a", path="/y.gguf"), Adapter(name="b", source="peft-only"))
    assert stored_adapter_problems(other_model, STORED) == [
        "profiles.p1.adapters[1].source: stored adapter 'peft-only' was trained for model 'hf', not 'm'"
    ]
    # llama.cpp loads GGUF only; vLLM serves the same adapter from peft's files.
    no_gguf = llama_profile(Adapter(name="a", source="peft-only"), model="hf")
    [problem] = stored_adapter_problems(no_gguf, STORED)
    assert problem.startswith("profiles.p1.adapters[0].source: stored adapter 'peft-only' has no GGUF file")
    vllm = llama_profile(
        Adapter(name="a", source="peft-only"),
        model="hf",
        engine="vllm",
        gpu_class="h100-80g",
        gpus_per_node=1,
    )
    assert stored_adapter_problems(vllm, STORED) == []


def test_a_spec_gets_exactly_the_files_its_engine_loads():
    spec = spec_of(Adapter(name="on-node", path="/a.gguf"), Adapter(name="kept", source="qa"))
    llama = with_stored_files(spec, STORED)
    assert llama.adapters[0] == spec.adapters[0]
    assert llama.adapters[1].files == (DIGESTS["adapter.gguf"],)
    vllm = with_stored_files(attrs.evolve(spec, engine="vllm"), STORED)
    assert vllm.adapters[1].files == (DIGESTS["adapter_model.safetensors"], DIGESTS["adapter_config.json"])
    with pytest.raises(AdapterUnavailable, match="adapter 'kept': no stored adapter 'qa' of model 'm'"):
        with_stored_files(spec, {})


def test_a_spec_whose_stored_adapter_has_no_path_yet_is_refused_at_launch():
    spec = with_stored_files(spec_of(Adapter(name="kept", source="qa")), STORED)
    assert validate(spec) == ["adapter 'kept': stored adapter 'qa' has no path on this node (not delivered)"]
    resolved = attrs.evolve(spec, adapters=(attrs.evolve(spec.adapters[0], path="/w/qa-1/adapter.gguf"),))
    plan = build_plan(resolved, engine_key=None, binaries=EngineBinaries())
    argv = plan.commands[-1].argv
    assert argv[argv.index("--lora") + 1] == "/w/qa-1/adapter.gguf"


@given(
    st.permutations(list(DIGESTS.values())), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
)
def test_a_copys_directory_names_its_exact_files_in_any_order(files, other_sha):
    files = tuple(files)
    assert manifest_digest(files) == manifest_digest(tuple(DIGESTS.values()))
    changed = (attrs.evolve(files[0], sha256=other_sha), *files[1:])
    assert (manifest_digest(changed) == manifest_digest(files)) == (other_sha == files[0].sha256)
    assert copy_name("qa", files).startswith("qa-") and len(copy_name("qa", files)) == len("qa-") + 12


# --- the node's copies ----------------------------------------------------------------------------


def pieces_of(name: str, files: dict[str, bytes]) -> list[AdapterPiece]:
    out = []
    for file, data in files.items():
        chunks = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)] or [b""]
        for index, chunk in enumerate(chunks):
            out.append(
                AdapterPiece(
                    name=name,
                    file=file,
                    index=index,
                    count=len(chunks),
                    data=base64.b64encode(chunk).decode(),
                    sha256=hashlib.sha256(chunk).hexdigest(),
                )
            )
    return out


def tree(root: Path) -> dict[str, bytes]:
    """The files under ``root`` and their bytes. The agent removes a partial copy in a thread: a
    directory or file that goes while it is read makes it read again (the removal only shrinks it)."""
    while root.exists():
        try:
            return {
                str(path.relative_to(root)): path.read_bytes()
                for path in sorted(root.rglob("*"))
                if path.is_file()
            }
        except FileNotFoundError:
            continue
    return {}


GGUF_ONLY = {"adapter.gguf": FILES["adapter.gguf"]}
GGUF_MANIFEST = (DIGESTS["adapter.gguf"],)


async def receive(cache: AdapterCache, name: str, files: dict[str, bytes], pieces=None) -> tuple[bool, str]:
    manifest = tuple(digest(n, d) for n, d in files.items())
    assert await cache.put(name, manifest) == (True, "send")
    for piece in pieces if pieces is not None else pieces_of(name, files):
        await cache.piece(piece)
    return await cache.done(name)


async def test_a_copy_is_received_verified_and_then_present(tmp_path: Path):
    cache = AdapterCache(tmp_path, run_as=None)
    ok, where = await receive(cache, "qa", GGUF_ONLY)
    target = cache.directory("qa", GGUF_MANIFEST)
    assert (ok, where) == (True, str(target))
    assert tree(target) == GGUF_ONLY
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert stat.S_IMODE((target / "adapter.gguf").stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o711
    assert list(cache.incoming_root.iterdir()) == []
    assert await cache.put("qa", GGUF_MANIFEST) == (True, f"present {target}")
    assert await cache.done("qa") == (False, "no adapter 'qa' is being received (PutAdapter first)")

    # A copy damaged since (truncated) is not present: it is sent again, and replaced whole.
    (target / "adapter.gguf").write_bytes(b"x")
    assert (await receive(cache, "qa", GGUF_ONLY))[0]
    assert tree(target) == GGUF_ONLY


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda ps: [attrs.evolve(ps[0], sha256="0" * 64), *ps[1:]], "sha256 of the piece does not match"),
        (lambda ps: ps[:-1], "incomplete: 524288 of 525522 bytes arrived"),
        (lambda ps: [ps[1], ps[0]], "expected piece 0"),
        (
            lambda ps: [ps[0], attrs.evolve(ps[1], data=base64.b64encode(b"y" * 1234).decode(),
                                            sha256=hashlib.sha256(b"y" * 1234).hexdigest())],
            "sha256 of the file does not match",
        ),
    ],
)  # fmt: skip
async def test_a_bad_piece_or_a_missing_one_keeps_nothing(tmp_path: Path, damage, reason):
    cache = AdapterCache(tmp_path, run_as=None)
    ok, message = await receive(cache, "qa", GGUF_ONLY, damage(pieces_of("qa", GGUF_ONLY)))
    assert not ok and reason in message, message
    assert not cache.directory("qa", GGUF_MANIFEST).exists()
    assert list(cache.incoming_root.iterdir()) == []


async def test_a_manifest_that_cannot_be_a_directory_is_refused(tmp_path: Path):
    cache = AdapterCache(tmp_path, run_as=None)
    ok, message = await cache.put("../up", GGUF_MANIFEST)
    assert not ok and "name: '../up' is not an adapter name" in message
    ok, message = await cache.put("qa", (attrs.evolve(GGUF_MANIFEST[0], name="../adapter.gguf"),))
    assert not ok and "is not a bare file name" in message
    assert not cache.root.exists() or list(cache.root.iterdir()) in ([], [cache.incoming_root])


async def test_abandoning_drops_what_was_being_received(tmp_path: Path):
    cache = AdapterCache(tmp_path, run_as=None)
    assert await cache.put("qa", GGUF_MANIFEST) == (True, "send")
    await cache.piece(pieces_of("qa", GGUF_ONLY)[0])
    assert tree(cache.incoming_root)
    await cache.abandon()
    assert list(cache.incoming_root.iterdir()) == []
    assert (await cache.done("qa"))[0] is False


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user's group")
async def test_as_root_the_copy_is_roots_and_readable_by_the_engines_group_only(tmp_path: Path):
    user = pwd.getpwnam("nobody")
    cache = AdapterCache(tmp_path, run_as="nobody")
    assert (await receive(cache, "qa", GGUF_ONLY))[0]
    target = cache.directory("qa", GGUF_MANIFEST)
    for path, mode in ((target, 0o750), (target / "adapter.gguf", 0o640)):
        info = path.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, user.pw_gid, mode)


async def test_resolve_gives_llamacpp_the_file_and_vllm_the_directory(tmp_path: Path):
    cache = AdapterCache(tmp_path, run_as=None)
    spec = with_stored_files(spec_of(Adapter(name="kept", source="qa")), STORED)
    with pytest.raises(
        NotDelivered, match="adapter kept not delivered: no complete copy of stored adapter 'qa'"
    ):
        cache.resolve(spec)
    assert (await receive(cache, "qa", GGUF_ONLY))[0]
    [adapter] = cache.resolve(spec).adapters
    assert adapter.path == str(cache.directory("qa", GGUF_MANIFEST) / "adapter.gguf")

    peft = {n: FILES[n] for n in ("adapter_model.safetensors", "adapter_config.json")}
    assert (await receive(cache, "qa", peft))[0]
    vllm_spec = with_stored_files(attrs.evolve(spec, engine="vllm"), STORED)
    [adapter] = cache.resolve(vllm_spec).adapters
    assert adapter.path == str(cache.directory("qa", vllm_spec.adapters[0].files))
    assert tree(Path(adapter.path)) == peft


# --- the supervisor -------------------------------------------------------------------------------


async def test_the_supervisor_fails_a_shard_whose_adapter_is_missing_and_starts_one_delivered(
    nursery: trio.Nursery, lab: Lab
):
    agent = await start_agent(nursery, lab)
    spec = attrs.evolve(
        with_stored_files(spec_of(Adapter(name="kept", source="qa")), STORED),
        port=free_port(),
    )
    ok, message = await agent.supervisor.start(spec, None)
    assert not ok and message.startswith("adapter kept not delivered")
    status = await agent.wait_state(spec.shard_id, FAILED)
    assert status.reason == message

    cache = AdapterCache(lab.work_dir, run_as=None)
    assert (await receive(cache, "qa", GGUF_ONLY))[0]
    spec = attrs.evolve(spec, shard_id="s2")
    assert await agent.supervisor.start(spec, None) == (True, "starting")
    await agent.wait_state(spec.shard_id, READY)
    [running] = agent.supervisor.running()
    assert running.spec == spec  # the server's spec, as it sent it
    argv = lab.state(spec.shard_id).processes[-1].argv
    assert argv[argv.index("--lora") + 1] == str(cache.directory("qa", GGUF_MANIFEST) / "adapter.gguf")
    await agent.supervisor.stop(spec.shard_id, grace=5)


# --- delivery over a real link ----------------------------------------------------------------------


@attrs.define
class Fleet:
    delivery: AdapterDelivery
    cache: AdapterCache
    link: AgentLink
    server_files: Path


async def fleet(nursery: trio.Nursery, tmp_path: Path) -> Fleet:
    server = await start_link_server(nursery, tmp_path / "server")
    server_files = tmp_path / "kept"
    (server_files / "qa").mkdir(parents=True)
    for name, data in FILES.items():
        (server_files / "qa" / name).write_bytes(data)
    cache = AdapterCache(tmp_path / "agent", run_as=None)
    link = AgentLink(
        node="n1",
        host="127.0.0.1",
        port=server.port,
        join_token=server.token,
        discover=lambda _address: fake_inventory("n1"),
        initial_delay=0.05,
        max_delay=0.5,
        rng=random.Random(1),
        adapters=cache,
    )
    nursery.start_soon(link.run)
    await wait_for(lambda: server.registry.session("n1") is not None, "the agent to register")
    delivery = AdapterDelivery(server.registry.session, lambda name, file: server_files / name / file)
    return Fleet(delivery=delivery, cache=cache, link=link, server_files=server_files)


async def test_the_server_delivers_an_adapter_once_and_its_copy_matches(
    nursery: trio.Nursery, tmp_path: Path
):
    f = await fleet(nursery, tmp_path)
    files = STORED["qa"].files
    # Two shards wanting it at once: one sends, the other then finds it present.
    async with trio.open_nursery() as both:
        for _ in range(2):
            both.start_soon(f.delivery.ensure, "n1", "qa", files)
    assert f.delivery.sent == 1
    assert tree(f.cache.directory("qa", files)) == FILES
    await f.delivery.ensure("n1", "qa", files)
    assert f.delivery.sent == 1


async def test_a_delivery_that_does_not_verify_fails_with_why_and_keeps_nothing(
    nursery: trio.Nursery, tmp_path: Path
):
    f = await fleet(nursery, tmp_path)
    # The server's copy changed under the store's record (same size, other bytes).
    damaged = bytearray(FILES["adapter.gguf"])
    damaged[-1] ^= 0xFF
    (f.server_files / "qa" / "adapter.gguf").write_bytes(bytes(damaged))
    with pytest.raises(DeliveryFailed) as failed:
        await f.delivery.ensure("n1", "qa", GGUF_MANIFEST)
    assert str(failed.value) == (
        "adapter qa: node n1 refused it: adapter.gguf: sha256 of the file does not match the announced one"
    )
    assert not f.cache.directory("qa", GGUF_MANIFEST).exists()
    assert list(f.cache.incoming_root.iterdir()) == []

    (f.server_files / "qa" / "adapter.gguf").write_bytes(b"short")
    with pytest.raises(DeliveryFailed, match="the server's .* is 5 bytes, the store says 525522"):
        await f.delivery.ensure("n1", "qa", GGUF_MANIFEST)
    with pytest.raises(DeliveryFailed, match="adapter qa: node n2 is not connected"):
        await f.delivery.ensure("n2", "qa", GGUF_MANIFEST)
    assert f.delivery.sent == 0


# --- the replica manager's step before StartShard ---------------------------------------------------


class RecordingDelivery:
    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, str, tuple[FileDigest, ...]]] = []
        self.fail = fail

    async def ensure(self, node: str, name: str, files: tuple[FileDigest, ...]) -> None:
        self.calls.append((node, name, files))
        if self.fail:
            raise DeliveryFailed(self.fail)


async def test_the_replica_manager_names_the_files_and_has_the_node_get_them_first():
    delivery = RecordingDelivery()
    manager = ReplicaManager(
        registry=None, catalog=None, engine_secret=None, stored_adapters=lambda: STORED, delivery=delivery
    )
    plain = spec_of(Adapter(name="on-node", path="/a.gguf"))
    assert await manager._deliver_adapters("n1", plain) is plain
    assert delivery.calls == []

    spec = await manager._deliver_adapters("n1", spec_of(Adapter(name="kept", source="qa")))
    assert spec.adapters[0].files == GGUF_MANIFEST
    assert delivery.calls == [("n1", "qa", GGUF_MANIFEST)]

    manager._delivery = RecordingDelivery(fail="adapter qa: node n1 refused it: disk full")
    with pytest.raises(DeliveryFailed, match="disk full"):
        await manager._deliver_adapters("n1", spec_of(Adapter(name="kept", source="qa")))
    manager._stored_adapters = dict
    with pytest.raises(AdapterUnavailable, match="no stored adapter 'qa'"):
        await manager._deliver_adapters("n1", spec_of(Adapter(name="kept", source="qa")))


async def test_a_link_that_ends_midway_fails_the_delivery_and_the_node_drops_the_part(
    nursery: trio.Nursery, tmp_path: Path
):
    f = await fleet(nursery, tmp_path)
    real_session_of = f.delivery._session_of

    class CutAfterFirstPiece:
        def __init__(self, session) -> None:
            self.session, self.node, self.pieces = session, session.node, 0

        async def call(self, command):
            return await self.session.call(command)

        async def send(self, message):
            await self.session.send(message)
            self.pieces += 1
            if self.pieces == 1:
                # Let the agent take the piece in before the link goes.
                await wait_for(lambda: tree(f.cache.incoming_root), "the first piece on the node")
                self.session.close("cut by the test")

    f.delivery._session_of = lambda node: CutAfterFirstPiece(real_session_of(node))
    with pytest.raises(DeliveryFailed, match="adapter qa: the link to node n1 ended during delivery"):
        await f.delivery.ensure("n1", "qa", GGUF_MANIFEST)
    await wait_for(lambda: not tree(f.cache.incoming_root), "the node to drop the partial copy")
    assert not f.cache.directory("qa", GGUF_MANIFEST).exists()

    # On the next link, the delivery starts over and completes.
    f.delivery._session_of = real_session_of
    await wait_for(lambda: f.link.registrations == 2 and f.link.connected, "the agent to come back")
    await wait_for(lambda: real_session_of("n1") is not None, "the new session")
    await f.delivery.ensure("n1", "qa", GGUF_MANIFEST)
    assert tree(f.cache.directory("qa", GGUF_MANIFEST)) == GGUF_ONLY

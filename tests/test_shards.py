"""A sharded executor (base_executor/shards.py): whole layers over several rank processes joined
by torch.distributed (gloo here, on CPU processes), tenants attached to every rank. Parity with
the unsplit model (and so with the executor of one process), placement, and a rank lost mid-call."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from symbiont import VirtLayer, connect, virtualize
from symbiont.base_executor import catalog as cat
from symbiont.base_executor import shards
from symbiont.base_executor.models import build_builtin
from symbiont.client.errors import ExecutorUnavailableError
from tests.conftest import Executor, running_executor
from tests.models import assert_sgd_steps_match, ids, lora_model
from tests.test_grpc import free_ports


def _children(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _kill_rank_mid_forward(rank: int, virt, x, then=lambda: None) -> Exception | None:
    """Stops `rank`'s process so virt(x) (then `then()`) waits for it on a thread, checks that it
    does, kills the rank and checks the thread ends: the exception the forward raised, if any."""
    os.kill(rank, signal.SIGSTOP)
    failure = []

    def forward():
        try:
            with torch.no_grad():
                virt(x)
            then()
        except Exception as e:
            failure.append(e)

    t = threading.Thread(target=forward)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "the forward did not wait for the stopped rank"
    os.kill(rank, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the tenant hangs after its rank died"
    return failure[0] if failure else None


def _lora_steps_match(name: str, url: str, **options) -> None:
    """Two SGD steps of a LoRA model virtualized at url (virtualize's options) match the unsplit
    model's; then its transports (one per rank) detach."""
    ref, virt = lora_model(name), virtualize(lora_model(name), url, **options)
    assert_sgd_steps_match(ref, virt, ids(2, 10, seed=5))
    for m in virt.modules():
        if isinstance(m, VirtLayer):
            m.transport.close()


def test_layers_are_contiguous_and_balanced():
    assert shards._contiguous_parts([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert shards._contiguous_parts([3, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert shards._contiguous_parts([0.1, 1, 1, 1, 1, 0.1], 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 ranks"):
        shards._contiguous_parts([1, 1, 1], 4)
    table = cat.UnitTable(build_builtin("tiny-llama"))
    two = shards.place_layers(table, 2)
    assert two["model.embed_tokens"] == two["model.layers.0.self_attn.q_proj"] == 0
    assert two["model.layers.1.mlp.down_proj"] == two["lm_head"] == 1
    assert two["model.layers.1.mlp"] == two["model.layers.1.mlp.{gate_proj,up_proj}"] == 1  # with their members
    four = shards.place_layers(table, 4)
    assert [four[u] for u in ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "lm_head")] == [0, 1, 2, 3]


def test_a_tied_unit_stays_with_its_owner():
    table = cat.UnitTable(build_builtin("tiny-gemma2"))  # lm_head is the embedding
    tied = [u for u in table.units.values() if u.tied_to]
    assert tied
    ranks = shards.place_layers(table, 2)
    assert all(ranks[u.id] == ranks[u.tied_to] for u in tied)


def test_one_device_is_one_process():
    assert shards.shard_config(None, "layers") is None or "WORLD_SIZE" in os.environ
    assert shards.shard_config("cuda:0", "layers") is None or "WORLD_SIZE" in os.environ
    with pytest.raises(ValueError, match="placement"):
        shards.ShardConfig(devices=("cpu", "cpu"), placement="rows", rank=0, world=2, local_rank=0, launched=True)


@pytest.mark.parametrize("placement", ["layers", "tensor"])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_executor_matches_the_unsplit_model(world, placement):
    """Logits, greedy tokens, LoRA gradients over two steps, through ranks over gloo: whole layers
    per rank (logits bitwise), or every unit's rows over every rank and each gated MLP block as
    Megatron's column- then row-parallel pair (its sum over the ranks, and the backward's, equal to
    rounding)."""
    name = "tiny-llama"
    with running_executor(name, "--devices", ",".join(["cpu"] * world), "--placement", placement) as ex:
        conn = connect(ex.url)
        ref, virt = build_builtin(name), virtualize(build_builtin(name), conn)
        assert sum(isinstance(m, VirtLayer) for m in virt.modules()) >= 8
        if placement == "layers":
            assert len(conn.catalog().shards) == world
            assert {u.rank for u in conn.catalog().units} == set(range(world))
            assert len({m.transport.url for m in virt.modules() if isinstance(m, VirtLayer)}) == world
        else:  # one address, rank 0's; whole-MLP units served as pairs
            assert not conn.catalog().shards and len(conn.transports) == 1
            assert [u for u in conn.catalog().units if u.kind == "mlp"]
            assert f"rank 0 of {world} leads every call" in ex.log()
        x = ids(2, 17)
        with torch.no_grad():
            a, b = ref(x).logits, virt(x).logits
        if placement == "layers":
            assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        prompt = ids(1, 6, seed=3)
        assert torch.equal(ref.generate(prompt, **kw), virt.generate(prompt, **kw))
        conn.close()

        _lora_steps_match(name, ex.url)


def test_any_rank_address_serves_the_whole_model_and_grpc_tenants_get_grpc_ranks():
    port = free_ports(2)
    with running_executor("tiny-llama", "--devices", "cpu,cpu", "--listen", f"grpc://127.0.0.1:{port}", "--insecure") as ex:
        x = ids(1, 9)
        with torch.no_grad():
            want = build_builtin("tiny-llama")(x).logits
        for url in (ex.url + ".r1", f"grpc://127.0.0.1:{port}"):
            with connect(url) as conn:
                virt = virtualize(build_builtin("tiny-llama"), conn)
                schemes = {t.url.partition("://")[0] for t in conn.transports}
                assert schemes == {url.partition("://")[0]}, [t.url for t in conn.transports]
                with torch.no_grad():
                    assert torch.equal(virt(x).logits, want)


@pytest.mark.parametrize("nodes", [1, 2])
def test_ranks_started_by_torchrun(tmp_path, nodes):
    """`torchrun ... -m symbiont.base_executor.cli serve --devices ...` (docs/sharding.md): two CPU
    ranks from one torchrun agent, or from two agents as two hosts would start them (here on one
    machine, static rendezvous), serving gRPC tenants at parity; torchrun's SIGTERM stops them."""
    import subprocess
    import sys

    from symbiont import wait_for_executor
    from tests.conftest import REPO

    port, per = free_ports(3), 2 // nodes
    master = port + 2  # (rank r listens on port + r)
    url = f"grpc://127.0.0.1:{port}"
    agents = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per),
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master),
               "-m", "symbiont.base_executor.cli", "serve", "--model", "tiny-llama", "--devices", ",".join(["cpu"] * per),
               "--listen", url, "--insecure"]
        log = open(tmp_path / f"node{node}.log", "wb")
        agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True))
    logs = lambda: "\n".join((tmp_path / f"node{n}.log").read_text(errors="replace") for n in range(nodes))  # noqa: E731
    try:
        try:
            wait_for_executor(url, 180, agents[0])
        except Exception as e:
            raise AssertionError(f"{e}\n{logs()}") from None
        with connect(url) as conn:
            assert len(conn.catalog().shards) == 2 and {u.rank for u in conn.catalog().units} == {0, 1}
            ref, virt = build_builtin("tiny-llama"), virtualize(build_builtin("tiny-llama"), conn)
            x = ids(2, 17)
            with torch.no_grad():
                assert torch.equal(ref(x).logits, virt(x).logits)
            kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert torch.equal(ref.generate(ids(1, 6, seed=3), **kw), virt.generate(ids(1, 6, seed=3), **kw))
        _lora_steps_match("tiny-llama", url)
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)  # (torchrun passes it to its workers)
        for a in agents:
            try:
                a.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait(10)


@pytest.mark.parametrize("placement", ["layers", "tensor"])
def test_a_rank_killed_mid_call_gives_every_tenant_a_typed_error_not_a_hang(placement):
    ex = Executor("tiny-llama", "--devices", "cpu,cpu", "--placement", placement)
    try:
        (rank1,) = _children(ex.pid)
        conn = connect(ex.url)
        virt = virtualize(build_builtin("tiny-llama"), conn)
        x = ids(1, 8)
        with torch.no_grad():
            virt(x)
        failure = _kill_rank_mid_forward(rank1, virt, x)  # (its part of each call, under tensor)
        assert isinstance(failure, ExecutorUnavailableError), failure
        assert ex.proc.wait(60) == 1  # rank 0 stops too, and says a rank was lost
        assert "rank 1" in ex.log() and "exited with code" in ex.log(), ex.log()
        with pytest.raises(ExecutorUnavailableError):
            with torch.no_grad():
                virt(x)
    finally:
        ex.stop()


def test_hosted_adapters_on_a_layer_placed_executor(tmp_path):
    """Two ranks, layer placement: a tenant's hosted adapter (each rank keeps its units' share, with
    its own id) and a provider's (`--adapters`) give the PEFT models' logits and greedy tokens;
    listing shows one adapter over both ranks; removed, it is gone from both; tensor placement
    refuses hosted adapters with a typed error."""
    from symbiont.client.errors import InvalidCallError

    name = "tiny-llama"
    shared = lora_model(name, seed=13).eval()
    shared.save_pretrained(tmp_path / "team")
    with running_executor(name, "--devices", "cpu,cpu", "--placement", "layers", "--adapters", str(tmp_path)) as ex:
        conn = connect(ex.url)
        own = lora_model(name, seed=14).eval()
        info = conn.host_adapter("own", own)
        assert sorted(info.units) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj"))
        assert set(conn.adapter_ids("own")) == {0, 1}, "each rank holds a share (tiny-llama: a layer each)"
        listed = {i.name: i for i in conn.adapters()}
        assert set(listed) == {"own", "team"} and len(listed["own"].units) == 4 and listed["team"].shared
        x = ids(1, 7)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        for adapter, ref in (("own", own), ("team", shared)):
            virt = virtualize(build_builtin(name), conn, adapter=adapter)
            with torch.no_grad():
                torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-6, atol=1e-6)
            assert torch.equal(virt.generate(x, **kw), ref.generate(x, **kw))
        conn.remove_adapter("own")
        assert [i.name for i in conn.adapters()] == ["team"]
        with pytest.raises(InvalidCallError, match="no adapter named"):
            conn.adapter_ids("own")
        conn.close()
    with running_executor(name, "--devices", "cpu,cpu", "--placement", "tensor") as ex, connect(ex.url) as conn:
        with pytest.raises(InvalidCallError, match="tensor placement"):
            conn.host_adapter("own", lora_model(name, seed=14))


@pytest.mark.parametrize("world", [1, 2])
def test_a_lazy_builtin_is_drawn_only_where_served(world):
    """A lazy built-in (models.BUILTINS[...].lazy: built with its unit weights on the meta device)
    draws each unit's weight on the rank that serves it and nowhere else: one executor, or two
    layer-placed ranks, give the logits, greedy tokens and LoRA steps of the model drawn whole on
    the tenant's CPU; each rank logs the units it drew."""
    name = "tiny-llama-lazy"
    devices = ("--devices", ",".join(["cpu"] * world)) if world > 1 else ()
    with running_executor(name, *devices) as ex:
        conn = connect(ex.url)
        catalog = conn.catalog()
        assert all(u.fingerprint.startswith("seeded:") for u in catalog.units)
        ref, virt = build_builtin(name), virtualize(build_builtin(name), conn)
        x = ids(2, 17)
        with torch.no_grad():
            assert torch.equal(ref(x).logits, virt(x).logits)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        prompt = ids(1, 6, seed=3)
        assert torch.equal(ref.generate(prompt, **kw), virt.generate(prompt, **kw))
        conn.close()
        _lora_steps_match(name, ex.url)
        # every rank logs how many units it drew (ranks 1.. into rank 0's output): each unit on one rank
        drawn = [int(line.split("drew the weights of ")[1].split()[0]) for line in ex.log().splitlines() if "drew the weights of" in line]
        # (a group's members; an MLP unit's and a layer span's are units and draw nothing of their own)
        members = {m for u in catalog.units if u.kind not in ("mlp", "span") for m in u.members}
        total = sum(1 for u in catalog.units if u.kind not in ("mlp", "span") and u.id not in members)
        assert len(drawn) == world and sum(drawn) == total and all(0 < n < total or world == 1 for n in drawn), (drawn, total)


def test_a_lazy_builtin_under_tensor_placement():
    """Each rank draws each unit of a lazy built-in, one at a time, and keeps its slice: the
    unsplit model's logits (to rounding), greedy tokens and LoRA steps."""
    name = "tiny-llama-lazy"
    with running_executor(name, "--devices", "cpu,cpu", "--placement", "tensor") as ex:
        conn = connect(ex.url)
        ref, virt = build_builtin(name), virtualize(build_builtin(name), conn)
        x = ids(2, 17)
        with torch.no_grad():
            torch.testing.assert_close(virt(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(ids(1, 6, seed=3), **kw), virt.generate(ids(1, 6, seed=3), **kw))
        conn.close()
        _lora_steps_match(name, ex.url)
        assert ex.log().count("this rank's slices of") == 2


def test_tensor_placement_with_unfused_members_on_ranks_that_hold_none_of_their_rows():
    """At 4 ranks a member of the q/k/v group has no rows on some ranks: its calls (unfused, each
    member alone) still take every rank's part, forward and backward (LoRA steps as unsplit)."""
    name = "tiny-llama"
    with running_executor(name, "--devices", "cpu,cpu,cpu,cpu", "--placement", "tensor") as ex:
        _lora_steps_match(name, ex.url, fuse=False)


def test_stats_command_and_prometheus_of_a_sharded_executor_show_the_totals_and_every_rank():
    """`base-executor stats URL` on an executor of two ranks: the totals over both, then each rank's
    own table, both ranks having served the tenant's calls (a rank's stats are its own); and its
    `--metrics-port` endpoint (one per host, on the first rank) with the same totals and each rank's."""
    import re
    import socket
    import subprocess
    import sys
    import urllib.request

    from tests.conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_executor("tiny-llama", "--devices", "cpu,cpu", "--metrics-port", str(port)) as ex, \
            connect(ex.url, name="ranked") as conn:
        with torch.no_grad():
            virtualize(build_builtin("tiny-llama"), conn)(ids(1, 6))
        out = subprocess.run([sys.executable, "-m", "symbiont.base_executor.cli", "stats", ex.url],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 ranks, their totals"), out.stdout
    assert f"== rank 0 ({ex.url})" in out.stdout and f"== rank 1 ({ex.url}.r1)" in out.stdout, out.stdout
    total, *per_rank = [int(n) for n in re.findall(r"^calls (\d+) \| batches", out.stdout, re.M)]
    assert len(per_rank) == 2 and all(n > 0 for n in per_rank) and sum(per_rank) == total, out.stdout
    assert out.stdout.count("ranked") == 3  # (the tenant is attached to both ranks: its merged row, then each rank's)

    def metric(line_start):
        return [float(line.split()[-1]) for line in body.splitlines() if line.startswith(line_start)]

    assert metric("symbiont_calls_total") == [total], body
    assert metric('symbiont_rank_calls_total{rank="0"}') == [per_rank[0]]
    assert metric('symbiont_rank_calls_total{rank="1"}') == [per_rank[1]]
    assert metric("symbiont_rank_up") == [1.0, 1.0]
    assert metric("symbiont_tenants ") == [1.0]  # (on both ranks: counted once)

"""A save_pretrained directory served by a sharded executor: each rank builds the model with its
unit weights on the meta device, reads everything else, and then only its own units' weights, or
under tensor placement its slices (base_executor/checkpoint.py); fingerprints come from sampled
elements of the memory-mapped files. Exact against the model loaded whole, end to end through two
rank processes over gloo."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from symbiont import connect, virtualize
from symbiont.base_executor import catalog as cat
from symbiont.base_executor import checkpoint, models
from symbiont.base_executor.models import build_builtin
from tests.conftest import running_executor
from tests.models import ids
from tests.test_shards import _lora_steps_match


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-phi3"])
@pytest.mark.parametrize("saved,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.bfloat16, torch.float32)])
def test_units_read_one_by_one_equal_the_model_loaded_whole(tmp_path, name, saved, dtype):
    """The same units (whole-MLP units included, probed on a stand-in block), the same
    fingerprints, and, once read, the same weights and non-unit state; several files too."""
    build_builtin(name, saved).save_pretrained(tmp_path, max_shard_size="20KB")  # (several files and an index)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    whole = models.load_model(str(tmp_path), dtype)
    full = cat.UnitTable(whole.model)
    loaded = models.load_model(str(tmp_path), dtype, rank_only=True)
    assert isinstance(loaded.source, checkpoint.Checkpoint)
    table = cat.UnitTable(loaded.model)
    loaded.source.fingerprints(table, torch.device("cpu"))
    assert set(table.units) == set(full.units)
    assert {u: table.units[u].fingerprint for u in full.units} == {u: v.fingerprint for u, v in full.units.items()}
    assert all(u.weight is None or u.weight.is_meta for u in table.units.values() if u.kind != "embedding" or u.tied_to)
    models.fill_units(table, loaded.source, torch.device("cpu"))
    for uid, u in full.units.items():
        if u.weight is not None:
            assert torch.equal(table.units[uid].weight, u.weight), uid
    state = {k: v for k, v in loaded.model.state_dict().items() if not table.is_unit_param(k)}
    expect = {k: v for k, v in whole.model.state_dict().items() if not full.is_unit_param(k)}
    assert state.keys() == expect.keys() and all(torch.equal(state[k], expect[k]) for k in expect)


def _no_safetensors(path):
    model = build_builtin("tiny-llama")
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")


def _untied_lm_head(path):
    """A tied model (GPT-2) saved with an lm_head of its own: transformers unties them."""
    from safetensors.torch import load_file, save_file

    build_builtin("tiny-gpt2").save_pretrained(path)
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["transformer.wte.weight"])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _pointer_file(path):
    """A Git LFS pointer where the weights should be."""
    build_builtin("tiny-llama").config.save_pretrained(path)
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 12\n")


@pytest.mark.parametrize("make", [_no_safetensors, _untied_lm_head, _pointer_file])
def test_what_it_cannot_read_rank_by_rank_is_not_read_so(tmp_path, make):
    make(tmp_path)
    assert checkpoint.open_rank_only(tmp_path, torch.float32) is None
    if make is not _pointer_file:  # (which transformers cannot load either)
        loaded = models.load_model(str(tmp_path), torch.float32, rank_only=True)
        assert not loaded.lazy and not any(p.is_meta for p in loaded.model.parameters())


@pytest.mark.parametrize("placement", ["layers", "tensor"])
def test_a_checkpoint_is_read_rank_by_rank(tmp_path, placement):
    """Two ranks serving a save_pretrained directory: a tenant's model loaded from the same
    directory passes virtualize's fingerprint check and gives the unsplit model's logits, greedy
    tokens and LoRA steps. Layers: each rank read only its own units. Tensor: each rank read only
    its slices' rows."""
    name = "tiny-llama"
    build_builtin(name).save_pretrained(tmp_path)
    with running_executor(str(tmp_path), "--devices", "cpu,cpu", "--placement", placement) as ex:
        conn = connect(ex.url)
        catalog = conn.catalog()
        assert [u for u in catalog.units if u.kind == "mlp"] and len(catalog.shards) == (2 if placement == "layers" else 0)
        whole = cat.UnitTable(models.load_model(str(tmp_path)).model)  # (each rank sampled its own units': exchanged)
        assert {u.id: u.fingerprint for u in catalog.units} == {uid: u.fingerprint for uid, u in whole.units.items()}
        if placement == "layers":
            with connect(ex.url + ".r1") as other:
                assert [(u.id, u.fingerprint) for u in other.catalog().units] == [(u.id, u.fingerprint) for u in catalog.units]
        ref = AutoModelForCausalLM.from_pretrained(tmp_path)
        virt = virtualize(AutoModelForCausalLM.from_pretrained(tmp_path), conn)  # (checks every unit's fingerprint)
        x = ids(2, 17)
        with torch.no_grad():
            a, b = ref(x).logits, virt(x).logits
        if placement == "layers":
            assert torch.equal(a, b)
        else:  # (row-parallel sums: equal to rounding)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        prompt = ids(1, 6, seed=3)
        assert torch.equal(ref.generate(prompt, **kw), virt.generate(prompt, **kw))
        conn.close()
        own = connect(ex.url)
        with torch.no_grad():  # (a tenant with no checkpoint: the skeleton's non-unit weights were read by rank 0)
            torch.testing.assert_close(own.model()(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        own.close()
        _lora_steps_match(name, ex.url)
        if placement == "tensor":
            assert ex.log().count("this rank's slices of") == 2
            return
        read = [int(line.split("read the weights of ")[1].split()[0]) for line in ex.log().splitlines() if "read the weights of" in line]
        members = {m for u in catalog.units if u.kind != "mlp" for m in u.members}  # (a group's; an MLP unit's are units)
        total = sum(1 for u in catalog.units if u.kind != "mlp" and u.id not in members)
        assert len(read) == 2 and sum(read) == total and all(0 < n < total for n in read), (read, total)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-phi3"])
def test_a_tensor_parallel_rank_reads_its_slices_equal_to_the_whole_models(tmp_path, name):
    """Every rank of 3 under tensor placement, its slices made from the checkpoint (rows read;
    a Conv1D's or a row-parallel down's columns kept from rows read whole) equal to those cut from
    the model loaded whole."""
    from symbiont.base_executor.tensor_parallel import TensorParallel

    build_builtin(name).save_pretrained(tmp_path)
    for rank in range(3):
        whole = TensorParallel(cat.UnitTable(models.load_model(str(tmp_path)).model), rank, 3, torch.device("cpu"))
        loaded = models.load_model(str(tmp_path), rank_only=True)
        parts = TensorParallel(cat.UnitTable(loaded.model), rank, 3, torch.device("cpu"), loaded.source)
        assert whole.parts.keys() == parts.parts.keys()
        for uid, want in whole.parts.items():
            got = parts.parts[uid]
            if want.mlp is not None:
                for w, g in zip(want.mlp.members, got.mlp.members):
                    assert torch.equal(g.weight, w.weight), (uid, rank)
            else:
                assert torch.equal(got.weight, want.weight) and got.ranges == want.ranges, (uid, rank)

"""Gangs of step programs (base_executor/transports/gangs.py) on the CPU: which programs may share
a gang (their calls' units, ops, shapes and dtypes; no hosted adapter), and no garbage collection
during a capture. Rounds themselves run on a GPU only (tests/test_gpu.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from symbiont.base_executor.graphs import capture_guard
from symbiont.base_executor.transports.gangs import MAX_ROW_BYTES, gang_key
from symbiont.proto import executor_pb2 as pb
from tests.test_scheduler import Q, call, core_for
from tests.test_scheduler import model  # noqa: F401  (the fixture)


def _program(core, tokens=1, seed=0):
    """A step program's calls as the executor holds them: x and out views of one mailbox."""
    c = call(core, 1, Q, tokens, t=0.0, latency=pb.INFERENCE, seed=seed)
    c.out = torch.empty(tokens, c.unit.out_features)
    return [c]


def test_programs_of_the_same_calls_share_a_key_and_others_do_not(model):  # noqa: F811  (the fixture)
    core = core_for(model)
    a, b = _program(core, seed=1), _program(core, seed=2)  # (two tenants' mailboxes: other addresses)
    assert gang_key(a) is not None and gang_key(a) == gang_key(b)
    assert gang_key(_program(core, tokens=2)) != gang_key(a)  # (other shapes: another gang)
    hosted = _program(core)
    hosted[0].adapter = object()  # (a hosted adapter's delta: its calls are computed alone)
    assert gang_key(hosted) is None
    merged = _program(core)
    merged[0].merge_epoch = 3
    assert gang_key(merged) is None
    big = _program(core, tokens=MAX_ROW_BYTES // (4 * 64) + 1)  # (a row over MAX_ROW_BYTES: not copied by a gang)
    assert gang_key(big) is None
    odd = _program(core, tokens=2)
    odd[0].x = odd[0].x.t()  # (not contiguous)
    assert gang_key(odd) is None


def test_no_garbage_collection_runs_while_a_graph_is_captured():
    """graphs.capture_guard: a collection inside a capture may destroy CUDA graphs of reference
    cycles, which invalidates the capture (session 48); it is off meanwhile and back after, also
    when the capture fails, and stays off where the caller had it off."""
    assert gc.isenabled()
    with capture_guard():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with capture_guard():
            raise ValueError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with capture_guard():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_rounds_word_kernels_wait_write_gather_and_scatter():
    """kernels/gang_words.py in Triton's interpreter (its kernels run one after another: a wait
    whose words are short would never end, so every wait here finds them reached, including
    cyclic seqs past 2^31): writes reach only the taking-part slots' words, gather and scatter copy
    only their rows."""
    from symbiont.base_executor.kernels import gang_words

    slots, n = 3, 5
    words = torch.zeros((slots, 2), dtype=torch.int32)
    rows = torch.arange(slots * n, dtype=torch.int32).view(slots, n) + 100
    table = torch.stack([torch.tensor([words[s].data_ptr(), words[s].data_ptr() + 4, rows[s].data_ptr()])
                         for s in range(slots)])
    seqs = torch.tensor([7, 0, -2**31 + 3], dtype=torch.int32)  # (slot 1 sits out; slot 2's seq wrapped around)
    gang_words.write(table, 0, seqs, from_seq=True)
    assert words[:, 0].tolist() == [7, 0, -2**31 + 3]
    gang_words.wait(table, 0, seqs, from_seq=True)  # (reached: returns)
    gang_words.write(table, 1, seqs, 4)
    assert words[:, 1].tolist() == [4, 0, 4]
    gang_words.wait(table, 1, seqs, 3)  # (4 - 3 >= 0 for each taking-part slot; slot 1's 0 is not looked at)
    words[0, 1] = 2**31 - 1  # (released: past every number)
    gang_words.wait(table, 1, seqs, 4)
    batch = torch.zeros(slots * n, dtype=torch.int32)
    gang_words.gather(table, 2, seqs, batch)
    assert batch.view(slots, n)[0].tolist() == rows[0].tolist() and batch.view(slots, n)[2].tolist() == rows[2].tolist()
    assert not batch.view(slots, n)[1].any()
    before = rows.clone()
    gang_words.scatter(-batch, table, 2, seqs)
    assert rows[0].tolist() == (-before[0]).tolist() and rows[2].tolist() == (-before[2]).tolist()
    assert torch.equal(rows[1], before[1])


def _lifted_while_waiting(wait, words: torch.Tensor, lifts: list) -> None:
    """Runs wait() (a kernel in Triton's interpreter) in a thread while this one writes
    `lifts` ((index, value) after a pause each) into `words`; fails if the wait passed before the
    last lift or has not passed 10 s after it."""
    import threading
    import time

    done = threading.Event()
    th = threading.Thread(target=lambda: (wait(), done.set()), daemon=True)  # (a wait that never ends: left to spin)
    th.start()
    for i, value in lifts:
        time.sleep(0.2)
        assert not done.is_set(), f"the wait passed before words[{i}] = {value}"
        words[i] = value
    assert done.wait(10), "the wait did not pass once its words were reached"


def test_a_rounds_wait_passes_once_every_slots_word_has_reached_its_own():
    """gang_words.wait spinning (Triton's interpreter, another thread writing the words): it passes
    only once every taking-part slot's word has reached its target, cyclically (a seq past 2^31),
    a word counted once it has reached (later dropped back: a release written over), and a
    sitting-out slot's word (its table entry 0: a lost mask would read address 0) never looked at;
    with `also`, the host's word beside a device word releases."""
    from symbiont.base_executor.kernels import gang_words
    from symbiont.proto.mailbox import RELEASED

    words = torch.zeros(6, dtype=torch.int32)
    table = torch.tensor([[words[0:].data_ptr(), words[3:].data_ptr()], [0, 0], [words[1:].data_ptr(), words[4:].data_ptr()]])
    seqs = torch.tensor([5, 0, 2**31 - 2], dtype=torch.int32)
    words[1] = 2**31 - 3  # (one short of slot 2's seq)
    _lifted_while_waiting(lambda: gang_words.wait(table, 0, seqs, from_seq=True), words,
                          [(0, 5), (0, 0), (1, -2**31 + 3)])  # (slot 0 reached then dropped: still counted; slot 2 past the wrap)
    words.zero_()
    _lifted_while_waiting(lambda: gang_words.wait(table, 0, seqs, 4, also=1), words,
                          [(0, 4), (4, RELEASED)])  # (slot 2: its host word released, its device word short)


def test_word_kernels_with_device_words_pass_on_the_host_words_release():
    """serve --device-words (proto/mailbox.py DEVICE_WORDS): a round writes a device word and the
    host's beside it; its wait looks at the device word, and at the host's every ALSO_EVERY turns,
    so a release written to the host's word (0x7FFFFFFF) lets it pass while the device word is short,
    and a stale number there does not (Triton's interpreter)."""
    from symbiont.base_executor.kernels import gang_words
    from symbiont.proto.mailbox import RELEASED

    slots = 2
    device, host = torch.zeros(slots, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32)
    table = torch.tensor([[device[s:].data_ptr(), host[s:].data_ptr()] for s in range(slots)])
    seqs = torch.tensor([3, 4], dtype=torch.int32)
    gang_words.write(table, 0, seqs, 6, also=1)
    assert device.tolist() == [6, 6] and host.tolist() == [6, 6]
    gang_words.wait(table, 0, seqs, 6, also=1)  # (reached on the device)
    device.zero_()
    host.fill_(RELEASED)
    gang_words.wait(table, 0, seqs, 7, also=1)  # (released on the host: passes at a look there)
    device[0], host[0] = 9, 0
    gang_words.wait(table, 0, seqs, 7, also=1)  # (one slot reached on the device, the other released)
    gang_words.write(table, 0, seqs, from_seq=True, also=1)
    assert device.tolist() == [3, 4] and host.tolist() == [3, 4]
    device.zero_()
    host.fill_(9)  # (a stale host word past the target: only a release passes there)
    _lifted_while_waiting(lambda: gang_words.wait(table, 0, seqs, 7, also=1), device, [(0, 7), (1, 7)])


def test_a_tenants_word_kernels_with_a_device_word():
    """client/transports/graph_words.py with a device word (serve --device-words): write stores it
    and the host's; wait and take pass once the device word is reached, or the host's word released
    (looked at every HOST_LOOK_EVERY turns), not on a stale number there; put copies, then stores both."""
    from symbiont.client.transports import graph_words
    from symbiont.proto.mailbox import RELEASED

    page, dev = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    graph_words.write(page, 2, 5, (dev, 3))
    assert page[2] == 5 and dev[3] == 5 and page.count_nonzero() == 1 and dev.count_nonzero() == 1
    graph_words.wait(page, 2, 5, (dev, 3))
    dev[3] = 0
    page[2] = RELEASED
    graph_words.wait(page, 2, 6, (dev, 3))  # (released on the host's word)
    src, dst, back = torch.arange(10, dtype=torch.int32), torch.zeros(10, dtype=torch.int32), torch.zeros(10, dtype=torch.int32)
    page.zero_()
    graph_words.put(page, 2, 7, dst, src, (dev, 3))
    assert torch.equal(dst, src) and page[2] == 7 and dev[3] == 7
    page[2] = 0
    graph_words.take(page, 2, 7, back, dst, (dev, 3))  # (the device word reached)
    assert torch.equal(back, src)
    dev[3], page[2] = 0, RELEASED
    graph_words.take(page, 2, 8, back, dst, (dev, 3))  # (released on the host's word)
    dev[3], page[2] = 0, 9  # (a stale host word past the target: only a release passes there)
    _lifted_while_waiting(lambda: graph_words.wait(page, 2, 8, (dev, 3)), dev, [(3, 8)])

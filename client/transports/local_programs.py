"""Step programs of the same-host transport (`local://NAME`), tenant side: the calls of a step
that client/step_graphs.py captures as one CUDA graph, recorded as the capture runs, defined at the
executor once, and run there each time the graph is replayed (base_executor/transports/programs.py
says how the executor runs them; docs/gpu.md, "Step programs").

While a capture records (begin_program .. end_program), a call makes no request: it queues, on the
capturing stream, the copy of its input into the mailbox, the write of its number (1, 2, ...) to
the mailbox's program input word and a wait for the program output word to reach it (one-program
kernels: client/transports/graph_words.py), then the copy of its result out; its request's header
is kept in order. end_program queues the output word's reset to 0 (the next replay counts from 1
again). With device words (serve --device-words) each program word is written to the device
region's one too, and the waits look there first (docs/gpu.md, "Device words"). A run
(run_program) is one call whose request names the program: our stream writes its input_seq to
the mailbox's input word, the step's graph is replayed, and our stream waits for the output word,
as for any call; its reply is taken later.
A mixin of LocalTransport (client/transports/local.py), which owns the mailbox and the replies.
"""
from __future__ import annotations

import torch

import threading

from symbiont.client.errors import InternalError, InvalidCallError
from symbiont.client.transports.local_calls import TAKE_EVERY
from symbiont.client.transports.unanswered import Sent, previous_seq
from symbiont.proto import executor_pb2 as pb
from symbiont.proto import mailbox
from symbiont.client.transports import graph_words
from symbiont.proto.cuda_ipc import as_tensor, copy_async, stream_write

SCRATCH_WORD = (mailbox.PROGRAM_SCRATCH_OFFSET - mailbox.WORDS_PAGE[0]) // 4  # the kernels' warm-up writes and waits here


def program_name(pid: int) -> str:
    """How a program's run is named (its errors, Sent.unit)."""
    return f"step program {pid}"

class StaleProgram(Exception):
    """The mailbox a program was defined on is gone (grown, or the tenant reattached): capture it again."""


class LocalPrograms:
    """Step programs of LocalTransport; `self` is the LocalTransport."""

    def programs_possible(self) -> bool:
        """Whether this transport's calls can be recorded into a step program now: a same-GPU
        mailbox whose words our GPU writes and waits on, its native call path, and calls that
        return before their replies (one tenant of this executor in the process)."""
        order = self._order
        return (self._box is not None and order is not None and bool(order.out_word) and not order.peer
                and not self._programs_broken
                and self._lane is not None and self.native_calls and self._early())

    def begin_program(self) -> None:
        """Starts recording the calls made (on a capturing stream) into a program. Every earlier
        call is answered first; the caller has synchronised our GPU."""
        with self._lock:
            if not self.programs_possible():
                raise InvalidCallError(f"{self.url}: this tenant's calls cannot be recorded into a step program")
            self._confirm()
            graph_words.warm(self._words_page(), SCRATCH_WORD, self._device_word(mailbox.DEVICE_SCRATCH))
            self._recording, self._recording_box, self._recorder = [], self._box, threading.get_ident()

    def end_program(self) -> list[bytes]:
        """Ends the recording: queues on the current stream (still capturing) the output word's reset;
        returns the recorded calls' headers, in order."""
        with self._lock:
            calls, self._recording = self._recording, None
            if calls:
                graph_words.write(self._words_page(), mailbox.PROGRAM_OUT_IN_PAGE // 4, 0,
                                  self._device_word(mailbox.DEVICE_PROGRAM_OUT))
            return calls

    def abort_program(self) -> None:
        with self._lock:
            self._recording = None

    def define_program(self, headers: list[bytes]) -> int:
        """Defines a recorded program at the executor (which captures its side); its id. Under the
        lock: a grow on another thread cannot come between the look at the mailbox and the definition."""
        with self._lock:
            box = self._recording_box
            if self._box is not box or self._order is None:
                raise StaleProgram("the mailbox changed while the program was recorded")
            # (its graph wrote and waited on the device words where the mailbox has them: _record)
            reply = self.control("program", pb.ProgramRequest(calls=headers, device_words=bool(self._order.device_words)))
            pid = reply.program.id
            self._program_headers[pid] = (box, pb.CallRequest(program=pid, latency=pb.INFERENCE).SerializeToString())
            return pid

    def run_program(self, pid: int, replay) -> None:
        """Runs program `pid`: its request, then replay() (the step's graph, on the current
        stream), then our stream's wait for the run's output word. Raises StaleProgram when the
        program must be captured again (its mailbox is gone, a run of it failed: dropped at the
        executor); an earlier call's failure as a call would."""
        with self._lock:
            box, header = self._program_headers.get(pid, (None, b""))
            name = program_name(pid)
            if name in self._unanswered.failed_programs:  # (refused at the executor: dropped there)
                self._unanswered.failed_programs.discard(name)
                self._program_headers.pop(pid, None)
                raise StaleProgram(f"a run of program {pid} failed: it is defined again")
            if box is None or box is not self._box or self._gone or box.detached:
                if self._box is not None and (self._gone or self._box.detached):
                    self._call_checks()
                raise StaleProgram(f"program {pid} was defined on a mailbox since replaced")
            self._call_checks()
            # (as a call's: from the look at _early() until its GPU wait is queued, a joining sibling waits for it)
            self._deciding = True
            try:
                self._run(pid, box, header, replay)
            finally:
                self._deciding = False
            if len(self._unanswered) >= TAKE_EVERY:
                self._collect()

    def _run(self, pid: int, box, header: bytes, replay) -> None:
        if not self.programs_possible():
            raise StaleProgram("this tenant's calls can no longer run as a program (another tenant of the process joined)")
        unanswered = self._unanswered
        failures = box.failures()
        if failures != self._failures or unanswered.failure is not None or unanswered.failed:
            self._failures = failures
            self._collect()
        order, lane = self._order, self._lane
        stream = order.current_stream()
        if stream != order.stream:
            order.follow(stream)
        # the program input word from 0 before the run's input word: the executor's first wait of this
        # run must not pass on the numbers of an earlier run it refused (its previous run's are past:
        # our stream waited for that run's output word); before the run counts as sent (a failure here
        # leaves no call waiting for a reply)
        stream_write(stream, self._program_words()[0], 0)
        if order.device_words:  # (serve --device-words: and the device region's, where the executor's GPU looks)
            stream_write(stream, order.device_words + mailbox.DEVICE_PROGRAM_IN, 0)
        call_id = next(self._ids)
        seq = order.seq = order.seq % 0xFFFFFFFF + 1
        unanswered.add(Sent(call_id, seq, program_name(pid), pb.FORWARD, (), None, program=True))
        try:
            rc = lane.send(0, 0, stream, header, call_id, seq, False)
        except BaseException:  # (the input word failed, or an interrupt as it returned)
            if lane.pushed != seq:  # (the request did not go: the output word is ours to write)
                unanswered.forget(call_id)
                self._release_failed(call_id, seq)
            else:  # (it went, and no graph of ours will write its words: the executor's waits go)
                self._abandon_run(box, stream)
                order.wait_result(stream, seq)
            raise
        if rc == -1:  # (nothing was done)
            unanswered.forget(call_id)
            order.seq = previous_seq(seq)
            raise InternalError("request ring full: another thread is using this tenant's transport without its lock")
        if rc == -2:  # (the input word went, the request did not: nobody answers it)
            unanswered.forget(call_id)
            self._release_failed(call_id, seq)
            raise InternalError("the step program's run could not be pushed to the request ring")
        launched = False
        try:
            replay()
            launched = True
        except BaseException:
            if not launched:
                self._abandon_run(box, stream)
            raise
        finally:
            order.wait_result(stream, seq)

    def _abandon_run(self, box, stream: int) -> None:
        """A run whose request went but whose graph was not launched: the executor's waits for its
        calls' inputs go (its results are garbage, nobody reads them), and, its output word left at
        the run's last number, no program runs on this mailbox any more. The release is written
        now and again on our stream (after the run's reset of the word queued there, which would
        otherwise undo it)."""
        box.release_program(output=False)
        self._program_headers.clear()
        self._programs_broken = True
        try:
            stream_write(stream, self._program_words()[0], mailbox.RELEASED)
        except RuntimeError:  # (the CPU's release is written; the caller's error is the one to raise)
            pass

    def _record(self, unit, op, x: torch.Tensor, out_shape, out_dtype, latency, take):
        """A call made while a program records (see the module)."""
        key = (unit, op, x.shape, x.dtype, latency, out_shape, out_dtype)
        plan = self._plans.get(key)
        if plan is None or x.device != self._order.device:
            raise InvalidCallError(f"{unit}: a call a step program records must have been made the same way "
                                   "before (its plan is made outside the capture)")
        if not x.is_contiguous():
            x = x.contiguous()
        stream = self._order.current_stream()
        k = len(self._recording) + 1
        page = self._words_page()
        dev_in, dev_out = self._device_word(mailbox.DEVICE_PROGRAM_IN), self._device_word(mailbox.DEVICE_PROGRAM_OUT)
        self._recording.append(plan.header)
        if graph_words.FUSED_HANDOVER and take is None:  # (two kernels: the input and the word, the wait and the result)
            src, mail, out = (graph_words.words(t) for t in (x, self._order.region.view(0, (plan.in_nbytes,), torch.uint8), plan.out))
            if None not in (src, mail, out):
                y = torch.empty_like(plan.out)  # (a fresh allocation: whole aligned words, as `out`)
                graph_words.put(page, mailbox.PROGRAM_IN_IN_PAGE // 4, k, mail, src, dev_in)
                graph_words.take(page, mailbox.PROGRAM_OUT_IN_PAGE // 4, k, graph_words.words(y), out, dev_out)
                return y
        copy_async(self._order.region.ptr, x.data_ptr(), plan.in_nbytes, stream, self._order.device)
        graph_words.write(page, mailbox.PROGRAM_IN_IN_PAGE // 4, k, dev_in)
        graph_words.wait(page, mailbox.PROGRAM_OUT_IN_PAGE // 4, k, dev_out)
        return plan.out.clone() if take is None else take(plan.out)

    def _program_words(self) -> tuple[int, int]:
        """Our GPU's addresses of the mailbox's program input and output words (driver stream operations)."""
        return mailbox.program_words(self._order.words)

    def _device_word(self, offset: int) -> tuple | None:
        """A step program's word in the device region (serve --device-words; proto/mailbox.py
        DEVICE_WORDS) as graph_words takes it, (int32 tensor, index); None without device words."""
        order = self._order
        if not order.device_words:
            return None
        if order.device_page is None:
            order.device_page = as_tensor(order.device_words, mailbox.DEVICE_WORDS_BYTES, order.device).view(torch.int32)
        return order.device_page, offset // 4

    def _words_page(self) -> torch.Tensor:
        """The mailbox's words page as our GPU maps it: an int32 CUDA tensor (kept per mailbox)."""
        order = self._order
        if order.page is None:
            order.page = as_tensor(order.words - mailbox.INPUT_WORD_IN_PAGE, mailbox.WORDS_PAGE[1], order.device).view(torch.int32)
        return order.page

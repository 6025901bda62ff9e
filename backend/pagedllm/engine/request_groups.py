"""Requests that run as several sequences: n / best_of samples (parallel_sampling) and beams (beam_search).

The engine asks this at four points of a request's life: when it is added (fan out), when a step's logits are
sampled (beams report their rows instead; a sample group's other samples draw beside its first), after the
step's progress is recorded (samples fork, beams choose, continue, fork or drop), and when a sequence finishes
(the group merges its outputs into the caller's request). Forks share blocks through `KVCacheManager.fork`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.engine.beam_search import BeamGroup
from pagedllm.engine.parallel_sampling import SampleGroup, sample_params
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class RequestGroups:
    def __init__(
        self, scheduler, kv, output_processor, eos_token_ids, decode: Callable[[list[int]], str]
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.output_processor = output_processor
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.groups: dict[str, SampleGroup | BeamGroup] = {}
        self._beam_ids = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    # --- fan out ------------------------------------------------------------------------
    def add(
        self, request_id: str, params: SamplingParams, make: Callable[[str, SamplingParams], Request]
    ) -> None:
        """Queue the request's first sequence; a sample group's others wait to fork from it."""
        if params.beam_width > 1:
            first = make(self._beam_id(request_id), params)
            group = BeamGroup(request_id, params, first, self.eos_token_ids, self.decode)
            members = [first]
        else:
            members = [make(f"{request_id}#s{i}", sp) for i, sp in enumerate(sample_params(params))]
            group = SampleGroup(request_id, params, members)
        taken = [m.request_id for m in members if m.request_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id: {taken[0]!r} is already in use")
        for m in members:
            m.group = group
        members[0].seqs_to_reserve = params.num_sequences
        self.scheduler.add_request(members[0])  # a full queue raises here: nothing is registered yet
        if isinstance(group, SampleGroup):  # beams never reach the output processor (the group decides)
            for m in members:
                self.output_processor.add_request(m)
        self.groups[request_id] = group

    def _beam_id(self, request_id: str) -> str:
        self._beam_ids += 1
        return f"{request_id}#b{self._beam_ids}"

    # --- sampling -----------------------------------------------------------------------
    def route_rows(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[list[int], list[tuple[int, Request]]]:
        """Which of the step's sampling rows the sampler draws from: beams' rows are reported to their groups
        instead; a sample group's waiting samples draw from their first sample's row (appended as extra rows).
        Returns (rows to sample, [(row, extra sample)])."""
        if not self.groups:
            return list(range(len(reqs))), []
        keep, extra = [], []
        for j, req in enumerate(reqs):
            group = req.group
            if isinstance(group, BeamGroup):
                group.report(req, torch.log_softmax(logits[j].float(), dim=-1).cpu())
                continue
            keep.append(j)
            if group is not None:
                extra += [(j, sib) for sib in group.siblings_to_sample(req)]
        return keep, extra

    # --- after the step's progress ------------------------------------------------------
    def after_step(self, emitted: dict, outputs: list[RequestOutput]) -> list[Request]:
        """Fork the samples drawn beside their first one (returned: they have their first token), and let
        every beam group whose beams have all reported choose. A finished beam search's output joins
        `outputs`."""
        if not self.groups:
            return []
        got = []
        for group in list(self.groups.values()):
            if isinstance(group, SampleGroup):
                if group.pending and group.samples[0].num_output_tokens:
                    got += self._fork_samples(group, emitted)
            elif group.ready:
                outputs += self._advance_beams(group)
        return got

    def _fork_samples(self, group: SampleGroup, emitted: dict) -> list[Request]:
        first, got = group.samples[0], []
        for sib in group.pending:
            if sib.is_finished or sib.request_id not in emitted:
                continue  # its sampling failed (it finished with an error)
            self._fork(first, sib, first.num_prompt_tokens)
            sib.append_output_token(emitted[sib.request_id][0].token_id)
            got.append(sib)
        group.forked()
        return got

    def _fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """`child` (num_tokens of parent's tokens) shares parent's blocks and runs beside it; if parent holds
        none (preempted or finished), it is computed afresh."""
        if parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent, child, num_tokens)
            child.num_computed_tokens = num_tokens
        self.scheduler.add_fork(child, parent)

    def _advance_beams(self, group: BeamGroup) -> list[RequestOutput]:
        choices = group.choose()
        chosen_once: set[str] = set()
        beams, extend = [], []
        for c in choices:  # forks first, from the parent's tokens before any is appended
            c.parent.seqs_to_reserve = 1  # the first beam's reservation is used up
            beam = c.parent
            if beam.request_id in chosen_once:
                beam = c.parent.fork(self._beam_id(group.request_id))
                self._fork(c.parent, beam, c.parent.num_computed_tokens)
            chosen_once.add(c.parent.request_id)
            beams.append(beam)
            extend.append((beam, c.token_id))
        for beam, token in extend:
            beam.append_output_token(token)
        kept = {b.request_id for b in beams}
        for old in group.beams:
            if old.request_id not in kept:
                self.scheduler.finish_request(old, RequestStatus.FINISHED_ABORTED)
        group.continue_with(beams, choices)
        if not group.done:
            return []
        del self.groups[group.request_id]
        return [group.output()]

    # --- finishing ----------------------------------------------------------------------
    def finished(self, req: Request) -> list[RequestOutput]:
        """Outputs for the caller when one of a group's sequences finished (stop, length, abort, timeout,
        error). A sample group merges it (and, if its first sample ends before the others forked, ends them
        the same way); a beam search ends at once with that reason, its other beams dropped."""
        group = req.group
        if isinstance(group, BeamGroup):
            if self.groups.pop(group.request_id, None) is None:
                return []  # already ended: its beams timed out together, and the first one ended it
            for beam in group.beams:
                if beam is not req:
                    self.scheduler.finish_request(beam, RequestStatus.FINISHED_ABORTED)
            return [group.output(req.status.finish_reason)]
        results = [group.merge(self.output_processor.finish(req))]
        if req is group.samples[0]:
            for sib in group.pending:  # never forked: they end as sample 0 did
                if not sib.is_finished:
                    sib.error = req.error
                    sib.set_status(req.status)
                    results.append(group.merge(self.output_processor.finish(sib)))
            group.forked()
        if all(s.is_finished for s in group.samples):
            self.groups.pop(group.request_id, None)
        return [r for r in results if r is not None]

    def members(self, request_id: str) -> list[Request]:
        """The live sequences of a group (to abort them)."""
        group = self.groups.get(request_id)
        if group is None:
            return []
        seqs = group.beams if isinstance(group, BeamGroup) else group.samples
        return [s for s in seqs if s.request_id in self.scheduler.requests]

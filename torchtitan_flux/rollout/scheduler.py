"""Rollout scheduling on the trainer's rank 0: prompts -> engine requests -> scored, versioned training batches.

``RolloutScheduler`` dispatches a step's prompts, split across the engines alive by measured speed, and collects
the results; every sample carries the policy version that generated it and the trainer version at dispatch.

Concurrency: main thread only, except reward scoring: a step's completions go to the reward pool
(``CompletionScorer``) when its last result arrives, and ``collect`` waits on that future only when it builds the
batch (so scoring overlaps training). Engines report through one ``events`` queue, which ``pump`` alone consumes:
results go to their step, acks and errors to ``_weight_event``, a dead engine to ``_replace`` (both no-ops here;
``rollouts.Rollouts`` overrides them). A dead engine's in-flight requests are re-dispatched, so no prompt is lost.

Streaming admission (``rollout.streaming_admission``): each prompt is its own request (one group), scored as soon as
its result arrives, and ``collect`` takes a step's batch from the first ``prompts_per_step`` groups to finish among
all dispatched steps (its own and those admitted ahead): among those finished, the oldest version first (a fresher
group can wait for the next step; an older one would go stale), else in arrival order. A finished group older than
the step's ``min_version`` by its oldest token is regenerated (``stale_samples`` counts it), never trained on. The
groups still generating when a step has its batch stay in flight for later steps (``rollout.streaming_carry_over``)
or, without carry-over, the step's own are restarted from scratch (``restarted_groups``). A step's prompts are
generated once each: a prompt taken by an earlier step is never dispatched again, and a checkpoint keeps which
prompts were taken and the finished groups not trained yet.

Multi-turn episodes (``rollout.environment``, ``episodes`` given): each prompt is a group of G episodes run by
``multiturn.EpisodeGroups`` on its own thread; each turn comes back through ``events`` as a ``TurnRequest``, which
``pump`` sends as a request of one sequence (so engines are only ever called from the main thread) and whose result
it hands back to the episode. While a step trains nobody pumps, so the trainer calls ``relay_turns`` between
transformer blocks (``run/threads.every_block``): it sends the turns waiting and hands back the turns' results,
never waits or pumps, and keeps every other event for ``pump`` (``_deferred``, read before the queue), so episodes go
on while the trainer computes. A group whose episodes all ended arrives as ``GroupEnded`` and becomes one finished
part (its tokens after the shared opening, ``model_mask`` on the model's), in both paths above alike; a turn on a
dead engine is re-dispatched like any request. An environment's failure is kept (``episode_failure``) and raised by
the next wait for rollouts, so a checkpoint's pumping never raises it.

A stuck engine: ``collect`` logs who holds what every ``WAIT_NOTE_S`` without a result (``waiting_note``); an engine
alive but holding requests with no result for ``rollout.engine_stall_seconds`` is killed (``pump``) and, like any
dead engine, restarted and its requests re-dispatched.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from torchtitan_flux.data.tasks import Prompt, Task, task_prompts
from torchtitan_flux.engine.base import EngineError, EngineHandler, GenerationRequest, GenerationResult, WeightAck
from torchtitan_flux.errors import NoEngineLeft, RolloutWaitInterrupted
from torchtitan_flux.data.rewards import Scores
from torchtitan_flux.rollout.batch import CompletionScorer, RolloutBatch, layout_batch
from torchtitan_flux.rollout.multiturn import (EpisodeGroups, GroupEnded, TurnRequest, env_input, episode_record,
                                               group_result, turn_seed)
from torchtitan_flux.rollout.split import SpeedSplit

logger = logging.getLogger("torchtitan_flux")


DEATH_NOTICE_S = 10.0  # how long a dispatch with no engine alive waits for a queued death (and its restart)
WAIT_NOTE_S = 30.0  # collect with no result for this long logs who holds what


@dataclass
class RequestPart:
    request: GenerationRequest
    engine: EngineHandler | None  # None: restored finished from a checkpoint
    first: int  # index of its first prompt in the step's prompt list
    result: GenerationResult | None = None
    sent: float = field(default_factory=time.monotonic)  # when it went to ``engine``
    # streaming admission: the group's decoded completions and the future of its scores, once its result arrived
    completions: list[str] | None = None
    scores: Future | None = None
    turn: TurnRequest | None = None  # a multi-turn episode's turn: its result goes to the episode, not to a step
    episodes: list | None = None  # a multi-turn group's episodes (``episodes.Episode``), once they all ended


@dataclass
class _Step:
    step: int
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    parts: list[RequestPart]
    n_dispatched: int = 0  # prompts [0, n_dispatched) have been sent to engines
    completions: list[str] | None = None  # decoded once every part has its result
    scores: Future | None = None  # rewards.Scores, computed by the scorer's pool
    taken: set[int] = field(default_factory=set)  # streaming admission: prompts (indices) a batch has trained on


class RolloutScheduler:
    def __init__(self, engines: list[EngineHandler], events: queue.Queue, task: Task, tokenizer, *, group_size: int,
                 prompts_per_step: int, max_new_tokens: int, temperature: float, top_k: int, seed: int, pad_id: int,
                 dead_zone: float = 0.1, max_share: float = 0.75, reward_workers: int = 1,
                 reward_timeout_s: float = 300.0, task_timeout_s: float = 300.0, stall_s: float = 600.0,
                 streaming: bool = False, carry_over: bool = True, episodes: EpisodeGroups | None = None):
        """``streaming``, ``carry_over``: ``rollout.streaming_admission`` and ``rollout.streaming_carry_over``;
        ``episodes``: multi-turn groups (``rollout.environment``; posting to ``events``), None: single-turn."""
        self.episodes = episodes
        self._groups: dict[int, RequestPart] = {}  # multi-turn groups running: request id -> part
        self._group_stats: dict[int, tuple[int, float]] = {}  # -> (newest version seen by its turns, when it started)
        self.episode_failure: BaseException | None = None  # the first group that failed (an environment's error)
        self.engines = list(engines)
        self.streaming, self.carry_over = streaming, carry_over
        self._ready: collections.deque[RequestPart] = collections.deque()  # streaming: finished groups, in order
        self.stale_samples = self.restarted_groups = 0  # streaming: regenerated as too stale; restarted unfinished
        self._arrived: list[RequestPart] = []  # streaming: groups finished since the last batch (``generated``)
        self.generated: dict[str, float] = {}  # streaming: mean length and reward of the groups finished during the
        # last collect's window, trained or not (the bias toward short completions: docs/benchmarks.md)
        self.events, self.task, self.tokenizer = events, task, tokenizer
        self.group_size, self.prompts_per_step = group_size, prompts_per_step
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.seed, self.pad_id = seed, pad_id
        self._req_ids = itertools.count()
        self._steps: dict[int, _Step] = {}
        self._by_req: dict[int, RequestPart] = {}
        self.split = SpeedSplit([e.name for e in self.engines], dead_zone, max_share)
        self.redispatched = self.engine_deaths = 0
        self.last_result = time.monotonic()  # when the newest generation result arrived
        self.stall_s = stall_s  # rollout.engine_stall_seconds
        self.task_timeout_s = task_timeout_s  # rollout.task_timeout_seconds: each call of the task's own code
        self._last_from: dict[str, float] = {}  # engine name -> when its newest result arrived
        self._stall_checked = 0.0
        self._last_pump = self._stall_clock_from = time.monotonic()
        self._deferred: collections.deque = collections.deque()  # events ``relay_turns`` read and left for ``pump``
        self.scoring = CompletionScorer(task, tokenizer, reward_workers, reward_timeout_s)
        self.interrupted = False  # set by ``interrupt`` (a signal handler may call it: a plain flag, no lock)

    def _new_step(self, step: int) -> _Step:
        prompts = task_prompts(self.task, self.seed, step, self.prompts_per_step, self.max_new_tokens,
                               self.task_timeout_s, interrupted=lambda: self.interrupted)
        ids = [self.tokenizer.encode(p.text, add_bos=p.add_bos, add_eos=False) for p in prompts]
        st = self._steps[step] = _Step(step, prompts, ids, [])
        return st

    def dispatch(self, step: int, trainer_version: int, pin_version: int = -1, min_version: int = 0) -> None:
        """Send all of ``step``'s prompts to the engines (once; later calls for the step do nothing), pinned to
        ``pin_version``, generated on ``min_version`` or newer (see ``GenerationRequest``)."""
        st = self._steps.get(step) or self._new_step(step)
        if st.n_dispatched:
            return
        if self.streaming:
            return self._dispatch_groups(st, trainer_version, pin_version, min_version)
        if self.episodes is not None:
            for i in range(len(st.prompts)):
                req = self._group_request(st, i, trainer_version, pin_version, min_version)
                st.parts.append(self._start_group(req, st.prompts[i], i))
            st.n_dispatched = len(st.prompts)
            return
        alive = self._alive()
        first = 0
        for engine, n in zip(alive, self.split.split(len(st.prompts), [e.name for e in alive])):
            if n:
                req = GenerationRequest(
                    req_id=next(self._req_ids), step=step, prompt_ids=st.prompt_ids[first : first + n],
                    group_size=self.group_size, max_new_tokens=self._budget(st.prompts[first : first + n]),
                    temperature=self.temperature,
                    top_k=self.top_k, seed=(self.seed * 1_000_003 + step) * 131 + first,
                    dispatch_version=trainer_version, min_version=min_version, pin_version=pin_version,
                )
                st.parts.append(self._send(req, engine, first))
            first += n
        st.n_dispatched = len(st.prompts)

    def _dispatch_groups(self, st: _Step, trainer_version: int, pin_version: int, min_version: int) -> None:
        """Streaming admission: one request per prompt not taken nor finished yet (a restored step has some), split
        over the engines alive by measured speed."""
        have = st.taken | {p.first for p in st.parts}
        todo = [i for i in range(len(st.prompts)) if i not in have]
        if self.episodes is not None:
            for i in todo:
                req = self._group_request(st, i, trainer_version, pin_version, min_version)
                st.parts.append(self._start_group(req, st.prompts[i], i))
            st.n_dispatched = len(st.prompts)
            return
        alive = self._alive()
        engines = [e for e, n in zip(alive, self.split.split(len(todo), [e.name for e in alive])) for _ in range(n)]
        for i, engine in zip(todo, engines):
            st.parts.append(self._send(self._group_request(st, i, trainer_version, pin_version, min_version),
                                       engine, i))
        st.n_dispatched = len(st.prompts)

    def _group_request(self, st: _Step, i: int, trainer_version: int, pin_version: int,
                       min_version: int) -> GenerationRequest:
        """Prompt ``i`` of ``st`` as a request of its own (streaming admission), seeded as in ``dispatch``."""
        return GenerationRequest(
            req_id=next(self._req_ids), step=st.step, prompt_ids=[st.prompt_ids[i]], group_size=self.group_size,
            max_new_tokens=self._budget([st.prompts[i]]), temperature=self.temperature, top_k=self.top_k,
            seed=(self.seed * 1_000_003 + st.step) * 131 + i, dispatch_version=trainer_version,
            min_version=min_version, pin_version=pin_version,
        )

    def _budget(self, prompts: list[Prompt]) -> int:
        """A request's ``max_new_tokens``: the largest of its prompts' budgets (``Prompt.max_new_tokens``)."""
        return max(p.max_new_tokens or self.max_new_tokens for p in prompts)

    def _alive(self) -> list[EngineHandler]:
        """The engines alive now. With none, pump for up to ``DEATH_NOTICE_S``: a death still queued gets its
        replacement (``_replace``) instead of ending the run."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            alive = [e for e in self.engines if e.alive()]
            if alive:
                return alive
            if time.monotonic() > deadline:
                raise NoEngineLeft("no rollout engine is alive")
            self.pump(0.05)

    def submit_eval(self, prompts: list[Prompt], prompt_ids: list[list[int]], n: int, temperature: float,
                    version: int, seed: int) -> list[RequestPart]:
        """Evaluation requests: ``n`` completions of each prompt (``prompt_ids``: their tokens) on exactly policy
        ``version``, split evenly over the engines alive, each request with its prompts' largest budget; their
        results come through ``pump`` like any other's."""
        if self.episodes is not None:  # a group of n episodes per prompt
            return [self._start_group(GenerationRequest(
                req_id=next(self._req_ids), step=0, prompt_ids=[ids], group_size=n, max_new_tokens=self.max_new_tokens,
                temperature=temperature, top_k=self.top_k, seed=seed * 131 + i, dispatch_version=version,
                min_version=version, pin_version=version), p, i) for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]
        alive = self._alive()
        parts, first = [], 0
        for i, engine in enumerate(alive):
            count = len(prompt_ids) // len(alive) + (i < len(prompt_ids) % len(alive))
            if count:
                req = GenerationRequest(
                    req_id=next(self._req_ids), step=0, prompt_ids=prompt_ids[first : first + count], group_size=n,
                    max_new_tokens=self._budget(prompts[first : first + count]), temperature=temperature,
                    top_k=self.top_k,
                    seed=seed * 131 + first, dispatch_version=version, min_version=version, pin_version=version,
                )
                parts.append(self._send(req, engine, first))
            first += count
        return parts

    def _send(self, req: GenerationRequest, engine: EngineHandler, first: int,
              turn: TurnRequest | None = None) -> RequestPart:
        part = RequestPart(req, engine, first, turn=turn)
        self._by_req[req.req_id] = part
        engine.submit(req)
        return part

    def _start_group(self, req: GenerationRequest, prompt: Prompt, first: int) -> RequestPart:
        """A multi-turn group (``req``: its prompt's budget, sampling, seed and versions; ``group_size`` episodes)
        started on the episodes' thread; its turns come back as ``TurnRequest``s, its end as ``GroupEnded``."""
        part = RequestPart(req, None, first)
        self._groups[req.req_id] = part
        self._group_stats[req.req_id] = (-1, time.monotonic())
        self.episodes.start(req.req_id, env_input(prompt), req.group_size)
        return part

    def _send_turn(self, turn: TurnRequest, alive: list[EngineHandler] | None = None) -> None:
        """An episode's turn as a request of one sequence, on the engine alive holding the fewest requests (among
        ``alive`` when given; else ``_alive()``, which may wait for a restart)."""
        group = self._groups.get(turn.group)
        if group is None:  # cancelled meanwhile
            return
        g = group.request
        req = GenerationRequest(
            req_id=next(self._req_ids), step=g.step, prompt_ids=[turn.prompt_ids], group_size=1,
            max_new_tokens=turn.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
            seed=turn_seed(g.seed, turn.episode, turn.turn), dispatch_version=g.dispatch_version,
            min_version=g.min_version, pin_version=g.pin_version,
        )
        held = collections.Counter(p.engine.name for p in self._by_req.values() if p.engine is not None)
        engine = min(alive or self._alive(), key=lambda e: held[e.name])
        self._send(req, engine, group.first, turn)

    def _turn_ended(self, part: RequestPart, result: GenerationResult) -> None:
        """A turn's tokens, logprobs and versions, to its episode."""
        turn, n = part.turn, int(result.lengths[0])
        if turn.group not in self._groups:  # cancelled meanwhile
            return
        newest, started = self._group_stats[turn.group]
        self._group_stats[turn.group] = (max(newest, result.newest_seen), started)
        self.episodes.answer(turn, (result.tokens[0, :n].tolist(), result.logprobs[0, :n].tolist(),
                                    result.versions_per_token()[0, :n].tolist()))

    def _group_ended(self, ev: GroupEnded) -> None:
        """A multi-turn group's end: one finished part (or, failed, the failure kept for the next wait)."""
        if not self.episodes.ended(ev.group):  # cancelled (restarted, discarded): dropped
            return
        part = self._groups.pop(ev.group)
        newest, started = self._group_stats.pop(ev.group)
        if ev.error is not None:
            self.episode_failure = self.episode_failure or ev.error
            return
        prompt, result = group_result(ev.group, ev.episodes, newest, time.monotonic() - started)
        part.request.prompt_ids, part.episodes = [prompt], ev.episodes
        st = self._steps.get(part.request.step)
        if st is not None:
            st.prompt_ids[part.first] = prompt
        self._finished(part, result)

    def _cancel_group(self, part: RequestPart) -> None:
        """Stop a multi-turn group still running and forget its turns in flight (their results are dropped)."""
        gid = part.request.req_id
        if self._groups.pop(gid, None) is None:
            return
        self._group_stats.pop(gid, None)
        self.episodes.cancel(gid)
        for req_id in [k for k, p in self._by_req.items() if p.turn is not None and p.turn.group == gid]:
            del self._by_req[req_id]

    def raise_episode_failure(self) -> None:
        """Raise the first multi-turn group's failure (an environment's ``UserCodeError``), if any."""
        if self.episode_failure is not None:
            raise self.episode_failure

    def pump(self, timeout: float) -> None:
        """Handle at most one engine event, waiting up to ``timeout`` seconds; once a second, kill stuck engines."""
        now = time.monotonic()
        if now - self._last_pump > 5.0:  # nobody pumped meanwhile (training, a save): results may sit unread in
            self._stall_clock_from = now  # the queue, so that time is no evidence of a stall
        self._last_pump = now
        if now - self._stall_checked >= 1.0 and not self.has_events():
            self._stall_checked = now
            self._kill_stuck(now)
        try:
            if self._deferred:
                ev = self._deferred.popleft()
            else:
                ev = self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
        except queue.Empty:
            return
        self._handle(ev)

    def has_events(self) -> bool:
        """Whether ``pump`` has an event to handle now."""
        return bool(self._deferred) or not self.events.empty()

    def relay_turns(self) -> None:
        """Send the multi-turn episodes' turns waiting and hand back their results, without waiting or pumping;
        every other event is kept, in order, for ``pump``, and so is a turn while no engine is alive (sending it
        would wait for a restart). Called between transformer blocks while a step trains (a queue read per call when
        there is nothing to relay): from the main thread, or on GPU from autograd's device thread for a backward
        block, while the main thread waits in ``backward()``: one thread at a time. Single-turn runs: nothing."""
        if self.episodes is None:
            return
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            part = self._by_req.get(ev.req_id) if isinstance(ev, GenerationResult) else None
            alive = [e for e in self.engines if e.alive()] if isinstance(ev, TurnRequest) else []
            if alive:  # never ``_alive()``, which pumps while it waits for a restart
                self._send_turn(ev, alive)
            elif part is not None and part.turn is not None:
                self._handle(ev)
            else:  # a turn with no engine alive waits for ``pump`` (and a restart) too
                self._deferred.append(ev)

    def _handle(self, ev) -> None:
        """One engine or episode event (``pump``, ``relay_turns``)."""
        if isinstance(ev, GenerationResult):
            self.last_result = self._last_from[ev.engine] = time.monotonic()
            part = self._by_req.pop(ev.req_id, None)
            if part is None:  # a re-dispatched request's late original, or a request of a discarded step
                logger.debug(f"dropped a late result (request {ev.req_id}, engine {ev.engine})")
            else:
                self.split.observe(ev.engine, ev.tokens.shape[0], ev.gen_time_s)
                if part.turn is not None:
                    self._turn_ended(part, ev)
                else:
                    self._finished(part, ev)
        elif isinstance(ev, TurnRequest):
            self._send_turn(ev)
        elif isinstance(ev, GroupEnded):
            self._group_ended(ev)
        elif isinstance(ev, WeightAck):
            self._weight_event(ev)
        elif isinstance(ev, EngineError):
            self._weight_event(ev)
            if ev.fatal:
                self._engine_died(ev.engine, ev.message)
            else:
                logger.warning(f"engine {ev.engine}: {ev.message}")

    def _finished(self, part: RequestPart, result: GenerationResult) -> None:
        """A part's result: scored with its group (streaming) or its step, once the step has all its parts."""
        part.result = result
        st = self._steps.get(part.request.step)  # None for evaluation requests (step 0)
        if st is not None and self.streaming:
            self._score_group(st, part)
        elif st is not None and all(p.result is not None for p in st.parts):
            self._score(st)

    def _weight_event(self, ev: WeightAck | EngineError) -> None:
        """An ack or engine error: nothing to do for the scheduler alone (``rollouts.Rollouts`` hands it to its
        syncer)."""

    def _replace(self, dead: EngineHandler) -> EngineHandler | None:
        """A dead engine's replacement, or None: the scheduler alone drops it (``rollouts.Rollouts`` restarts it)."""
        return None

    def _kill_stuck(self, now: float) -> None:
        for e in self.engines:
            parts = [p for p in self._by_req.values() if p.engine is e]
            if not parts or not e.alive():
                continue
            idle = now - max(self._last_from.get(e.name, 0.0), min(p.sent for p in parts), self._stall_clock_from)
            if idle > self.stall_s and not e.reconnects:  # a server's own HTTP timeouts cover its calls
                e.kill(f"no result for {idle:.0f} s while holding {len(parts)} requests "
                       f"(rollout.engine_stall_seconds = {self.stall_s:g}): declared stuck and stopped")

    def _engine_died(self, name: str, message: str) -> None:
        dead = next((e for e in self.engines if e.name == name), None)
        if dead is None:
            return
        self.engine_deaths += 1
        logger.error(f"rollout engine {name} died: {message.strip().splitlines()[-1] if message else ''}")
        replacement = self._replace(dead)
        if replacement is None:
            self.engines.remove(dead)
        else:
            self.engines[self.engines.index(dead)] = replacement
            self.split.replace(name, replacement.name)
        for part in [p for p in self._by_req.values() if p.engine is dead]:
            alive = [e for e in self.engines if e.alive()]
            if not alive:
                raise NoEngineLeft("every rollout engine died (and none could be restarted or reconnected)")
            target = next(e for e in alive if e.name == self.split.fastest([a.name for a in alive]))
            del self._by_req[part.request.req_id]
            part.request.req_id = next(self._req_ids)
            part.engine, part.sent = target, time.monotonic()
            self._by_req[part.request.req_id] = part
            target.submit(part.request)
            self.redispatched += 1

    def collect(self, step: int, trainer_version: int, pin_version: int = -1, min_version: int = 0) -> RolloutBatch:
        """Dispatch ``step`` (unless admission already has), wait for all its parts and build its batch (scored,
        laid out for training). Streaming admission: the first groups to finish instead (``_collect_groups``)."""
        self.raise_episode_failure()
        self.dispatch(step, trainer_version, pin_version=pin_version, min_version=min_version)
        if self.streaming:
            return self._collect_groups(step, trainer_version, pin_version, min_version)
        st = self._steps[step]
        waiting = _WaitNotes(self, step)
        while any(p.result is None for p in st.parts):
            waiting.pump()
        del self._steps[step]
        self._score(st)  # (a step restored finished from a checkpoint is scored here)
        return self._build(st)

    def _collect_groups(self, step: int, trainer_version: int, pin_version: int, min_version: int) -> RolloutBatch:
        """Streaming admission's batch of ``step``: the first ``prompts_per_step`` groups to finish that are fresh
        enough for ``min_version`` (by their oldest token), the oldest first among those finished when one is taken;
        stale ones are regenerated (module docstring)."""
        for k, st in sorted(self._steps.items()):  # restored from a checkpoint, older than the admission's steps
            if k < step and not st.n_dispatched:
                self._dispatch_groups(st, trainer_version, pin_version, min_version)
        chosen: list[RequestPart] = []
        waiting = _WaitNotes(self, step)
        try:
            while len(chosen) < self.prompts_per_step:
                if not self._ready:
                    waiting.pump()
                    continue
                while self.has_events():  # every group finished by now is a candidate
                    self.pump(0)
                part = min(self._ready, key=lambda p: p.result.version)  # the oldest first (ties: arrival order):
                self._ready.remove(part)  # a fresher one can wait a step, an older one would go stale
                if part.result.version >= min_version:  # the bound is on the oldest token (GenerationResult.version)
                    chosen.append(part)
                    continue
                self.stale_samples += part.result.tokens.shape[0]
                logger.info(f"step {step}: a group of step {part.request.step} from version {part.result.version} is "
                            f"older than {min_version} allows (off_policy.max_version_gap); regenerating it")
                self._restart(self._steps[part.request.step], part, trainer_version, pin_version, min_version)
        except BaseException:  # interrupted: the groups chosen so far stay ready, in their order
            self._ready.extendleft(reversed(chosen))
            raise
        for part in chosen:
            self._steps[part.request.step].taken.add(part.first)
        if not self.carry_over:
            mine = self._steps[step]
            for part in [p for p in mine.parts if p.result is None and p.first not in mine.taken]:
                self.restarted_groups += 1
                self._restart(mine, part, trainer_version, pin_version, min_version)
        batch = self._build_groups(step, sorted(chosen, key=lambda p: (p.request.step, p.first)))
        self.generated = self._generated_stats()
        for k in [k for k, st in self._steps.items() if k <= step and len(st.taken) == len(st.prompts)]:
            del self._steps[k]  # a step ahead stays, even fully taken: its dispatch must not start it afresh
        return batch

    def _restart(self, st: _Step, part: RequestPart, trainer_version: int, pin_version: int,
                 min_version: int) -> None:
        """Generate ``part``'s group afresh (streaming admission); its old request's result, if any, is dropped."""
        self._by_req.pop(part.request.req_id, None)
        st.parts.remove(part)
        req = self._group_request(st, part.first, trainer_version, pin_version, min_version)
        if self.episodes is not None:
            self._cancel_group(part)
            st.parts.append(self._start_group(req, st.prompts[part.first], part.first))
            return
        alive = self._alive()
        engine = next(e for e in alive if e.name == self.split.fastest([a.name for a in alive]))
        st.parts.append(self._send(req, engine, part.first))

    def _generated_stats(self) -> dict[str, float]:
        """Mean completion length (the model's tokens: a multi-turn episode's environment tokens left out) and reward
        of every group finished since the last batch (their rewards waited for), trained or not; the window starts
        afresh."""
        arrived, self._arrived = self._arrived, []
        lengths = [float(x) for p in arrived for x in (p.result.lengths if p.result.model_mask is None
                                                        else p.result.model_mask.sum(1)).tolist()]
        scores = [self.scoring.wait(p.scores, lambda: self.interrupted) for p in arrived]
        rewards = [r for got in scores if got is not None for r in got.total]  # None: interrupted (the run stops)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {"generated_completion_len_mean": mean(lengths), "generated_reward_mean": mean(rewards)}

    def _score_group(self, st: _Step, part: RequestPart) -> None:
        """Streaming admission: decode a finished group and hand it to the reward pool; it is ready to be taken."""
        part.completions, part.scores = self.submit_scores(self.task, [st.prompts[part.first]], [part],
                                                           self.group_size)
        self._ready.append(part)
        self._arrived.append(part)

    def _build_groups(self, step: int, parts: list[RequestPart]) -> RolloutBatch:
        """The batch of streaming admission's ``parts`` (each a group, of any step), scored."""
        scores = []
        for part in parts:
            got = self.scoring.wait(part.scores, lambda: self.interrupted)
            if got is None:
                raise RolloutWaitInterrupted(f"interrupted while waiting for the rewards of step {step}")
            scores.append(got)
        steps = [self._steps[p.request.step] for p in parts]
        return _with_episodes(layout_batch(step, [st.prompts[p.first] for st, p in zip(steps, parts)],
                                           [st.prompt_ids[p.first] for st, p in zip(steps, parts)],
                                           [(p.request, p.result) for p in parts], Scores.concat(scores),
                                           [c for p in parts for c in p.completions], self.group_size, self.pad_id),
                              parts)

    def interrupt(self) -> None:
        """Make ``collect`` raise ``RolloutWaitInterrupted`` within ~50 ms; safe to call from a signal handler."""
        self.interrupted = True

    def _score(self, st: _Step) -> None:
        """Decode ``st``'s completions and hand them to the reward pool (once)."""
        if st.scores is None:
            parts = sorted(st.parts, key=lambda p: p.first)
            st.completions, st.scores = self.submit_scores(self.task, st.prompts, parts, self.group_size)

    def submit_scores(self, task: Task, prompts: list[Prompt], parts: list[RequestPart],
                      n: int) -> tuple[list[str], Future]:
        """The finished ``parts`` of ``prompts`` (``n`` samples each, in order) to the reward pool: (completion
        texts, future of their scores); multi-turn groups are scored as conversations (``submit_episodes``)."""
        if parts and parts[0].episodes is not None:
            return self.scoring.submit_episodes(task, prompts, [p.episodes for p in parts])
        return self.scoring.submit(task, prompts, [p.result for p in parts], n)

    def _build(self, st: _Step) -> RolloutBatch:
        parts = sorted(st.parts, key=lambda p: p.first)
        # a reward function's error, or one past rollout.reward_timeout_seconds (RewardError), stops the run here
        scores = self.scoring.wait(st.scores, lambda: self.interrupted)
        if scores is None:
            raise RolloutWaitInterrupted(f"interrupted while waiting for the rewards of step {st.step}")
        return _with_episodes(layout_batch(st.step, st.prompts, st.prompt_ids, [(p.request, p.result) for p in parts],
                                           scores, st.completions, self.group_size, self.pad_id), parts)

    def discard(self, step: int) -> None:
        """Forget ``step``'s requests (their results will be dropped); the next dispatch starts it afresh."""
        st = self._steps.pop(step, None)
        for part in st.parts if st else []:
            self._by_req.pop(part.request.req_id, None)
            if self.episodes is not None:
                self._cancel_group(part)

    def state_dict(self, timeout: float) -> dict:
        """The finished rollouts of dispatched steps, for a checkpoint, after waiting up to ``timeout`` seconds for
        those in flight. A step still unfinished is left out and generated afresh on resume."""
        deadline = time.monotonic() + timeout
        while (self._by_req or self._groups) and time.monotonic() < deadline:
            waiting = any(e.alive() for e in self.engines)  # else: only take the results already queued
            try:
                self.pump(0.05 if waiting else 0)
            except NoEngineLeft:
                waiting = False
            if not waiting and not self.has_events():
                break
        if self.streaming:  # which prompts were taken, and the finished groups not trained yet, in arrival order
            return {"streaming": {"taken": {st.step: sorted(st.taken) for st in self._steps.values()},
                                  "ready": [(p.request.step, p.first, p.request, p.result, p.episodes)
                                            for p in self._ready]}}
        done = [st for st in self._steps.values() if all(p.result is not None for p in st.parts)]
        return {"steps": [{"step": st.step, "n_dispatched": st.n_dispatched,
                           "parts": [(p.first, p.request, p.result, p.episodes) for p in st.parts]} for st in done]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the finished rollouts of ``state_dict``; they are trained on as they are, never regenerated.
        Streaming admission's: a restored step dispatches only its prompts neither taken nor finished. Rollouts
        saved with the other ``rollout.streaming_admission`` are generated afresh (nothing trained is lost)."""
        if ("streaming" in state) != self.streaming and (state.get("steps") or state.get("streaming")):
            logger.warning("the checkpoint's rollouts were saved with rollout.streaming_admission = "
                           f"{not self.streaming}; they are generated afresh")
            return
        if self.streaming:
            saved = state["streaming"]
            for k, taken in saved["taken"].items():
                self._new_step(k).taken = set(taken)
            for k, first, req, result, *episodes in saved["ready"]:  # (saved before multi-turn: no episodes)
                st = self._steps.get(k) or self._new_step(k)
                part = _restored(st, first, req, result, episodes)
                st.parts.append(part)
                self._score_group(st, part)
            return
        for saved in state.get("steps", []):
            st = self._new_step(saved["step"])
            st.n_dispatched = saved["n_dispatched"]
            st.parts = [_restored(st, first, req, result, episodes) for first, req, result, *episodes in saved["parts"]]

    def drain(self, timeout: float = 5.0) -> None:
        """Forget outstanding requests (shutdown); results that still arrive are dropped."""
        deadline = time.monotonic() + timeout
        try:
            while self._by_req and time.monotonic() < deadline:
                self.pump(0.05)
        except NoEngineLeft:  # shutting down anyway: not the run's outcome (which the caller is reporting)
            pass
        if self.episodes is not None:
            self.episodes.close()
        self._groups.clear()
        self._steps.clear()
        self._by_req.clear()
        self._ready.clear()
        self.scoring.close()


def _restored(st: _Step, first: int, req: GenerationRequest, result: GenerationResult, episodes: list) -> RequestPart:
    """A finished part from a checkpoint; a multi-turn group's opening is its prompt."""
    part = RequestPart(req, None, first, result, episodes=episodes[0] if episodes else None)
    if part.episodes is not None:
        st.prompt_ids[first] = req.prompt_ids[0]
    return part


def _with_episodes(batch: RolloutBatch, parts: list[RequestPart]) -> RolloutBatch:
    """``batch`` with its multi-turn episodes (for ``completions.jsonl``), one per sample in order."""
    if parts and parts[0].episodes is not None:
        batch.episodes = [episode_record(ep) for p in parts for ep in p.episodes]
    return batch


class _WaitNotes:
    """``collect``'s wait for step ``step``'s rollouts, one ``pump`` at a time: raises ``RolloutWaitInterrupted`` on
    ``interrupt``, logs ``waiting_note`` every ``WAIT_NOTE_S`` without a result."""

    def __init__(self, scheduler: RolloutScheduler, step: int):
        self.scheduler, self.step = scheduler, step
        self.start = self.noted = time.monotonic()

    def pump(self) -> None:
        sched = self.scheduler
        if sched.interrupted:
            raise RolloutWaitInterrupted(f"interrupted while waiting for the rollouts of step {self.step}")
        sched.pump(0.05)
        sched.raise_episode_failure()
        now = time.monotonic()
        if now - max(sched.last_result, self.start) >= WAIT_NOTE_S and now - self.noted >= WAIT_NOTE_S:
            logger.warning(waiting_note(self.step, now - self.start, sched.engines, list(sched._by_req.values()),
                                        sched.last_result))
            self.noted = now


def waiting_note(step: int, waited: float, engines: list[EngineHandler], in_flight: list[RequestPart],
                 last_result: float) -> str:
    """One line: how long step ``step`` has waited, and what each engine holds of the requests in flight."""
    now = time.monotonic()
    held = []
    for e in engines:
        parts = [p for p in in_flight if p.engine is e]
        state = "alive" if e.alive() else "dead"
        if not parts:
            held.append(f"{e.name} ({state}): nothing in flight")
            continue
        steps = sorted({p.request.step for p in parts})
        n = sum(len(p.request.prompt_ids) * p.request.group_size for p in parts)
        versions = sorted({str(r.pin_version) if r.pin_version >= 0 else f">= {r.min_version}"
                           for r in (p.request for p in parts)})
        held.append(f"{e.name} ({state}): {len(parts)} requests, {n} completions of steps "
                    f"{', '.join(map(str, steps))} on weight version {', '.join(versions)}, the oldest sent "
                    f"{now - min(p.sent for p in parts):.0f} s ago")
    return (f"step {step}: waiting {waited:.0f} s for rollouts, none arrived for {now - last_result:.0f} s; "
            + "; ".join(held))

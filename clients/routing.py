"""Choosing which computed serves a request: cache-aware (ask blockd) or round robin.

Pure policy, no I/O: the clients fetch the token ids, blockd's Route answer and the
workers' ModelInfo, and ask these objects which known worker to use and what to send it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from clients.requests import Prompt
from clients.types import ModelInfo, Route

ROUTING_MODES = ("cache-aware", "round-robin")

_LOOPBACK_NAMES = {"localhost": "127.0.0.1", "[::1]": "127.0.0.1", "ip6-localhost": "127.0.0.1"}


def normalize_address(address: str) -> str:
    """host:port with loopback names folded together and a dns:/// or ipv4: prefix removed."""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        address = address.removeprefix(prefix)
    host, sep, port = address.rpartition(":")
    if not sep:
        return address
    return f"{_LOOPBACK_NAMES.get(host.lower(), host)}:{port}"


def validate_mode(mode: str) -> str:
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
    return mode


class RoundRobin:
    """Cycles through a fixed, non-empty list of addresses; safe to share between threads."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("need at least one computed address")
        self._addresses = tuple(addresses)
        self._next = 0
        self._lock = threading.Lock()

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def next(self) -> str:
        with self._lock:
            address = self._addresses[self._next % len(self._addresses)]
            self._next += 1
            return address


def choose_routed(route: Route, addresses: Sequence[str]) -> str | None:
    """The first worker in blockd's ranking that this client knows, as the client spells it.

    blockd ranks every live pool (longest cached prefix first, load breaking ties).
    Its addresses are those the workers registered; a worker this client was not
    given (another tenant's, or one only reachable inside a container network) is
    skipped. None when no known worker is ranked.
    """
    known = {normalize_address(a): a for a in addresses}
    ranked = [route.worker_address] if route.worker_address else []
    ranked += [c.worker_address for c in route.candidates]
    for worker in ranked:
        mine = known.get(normalize_address(worker)) if worker else None
        if mine is not None:
            return mine
    return None


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids as the tokenizer of `worker_address` produced them (for Route)."""

    worker_address: str
    token_ids: tuple[int, ...]

    def apply(self, prompt: Prompt) -> Prompt:
        """`prompt` carrying these token ids instead of its text or messages.

        Generate treats token ids exactly as it treats the text or messages they came
        from (same tokenizer, same chat template), so the worker need not tokenize again.
        An empty prompt stays as it is: Generate refuses it, and must go on doing so.
        """
        if prompt.token_ids is not None or not self.token_ids or not (prompt.text or prompt.messages):
            return prompt
        return dataclasses.replace(prompt, text=None, messages=None, token_ids=self.token_ids)


# Workers that agree on these serve the same weights and config, hence one tokenizer and
# chat template (they share one hash namespace in blockd, too).
TokenizerIdentity = tuple[str, str, int, bool]


def tokenizer_identity(info: ModelInfo) -> TokenizerIdentity:
    return (info.model_id, info.model_revision, info.vocab_size, info.has_chat_template)


class Router:
    """The routing state of one client: the mode, the round robin, what each worker serves.

    Invariants: every address answered is one of `addresses`, as the caller spelled it;
    num_routed + num_round_robin == the number of `place` calls; token ids go only to a
    worker known to tokenize as the worker that produced them (unknown: the prompt as given).
    """

    def __init__(self, mode: str, addresses: Sequence[str]) -> None:
        self.mode = validate_mode(mode)
        self._round_robin = RoundRobin(addresses)
        self._identities: dict[str, TokenizerIdentity] = {}
        self.num_routed = 0  # requests placed by blockd's Route
        self.num_round_robin = 0  # requests placed by round robin (mode, or fallback)

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._round_robin.addresses

    @property
    def asks_blockd(self) -> bool:
        """Whether a request is tokenized and routed by blockd (else: round robin)."""
        return self.mode == "cache-aware" and len(self.addresses) > 1

    def place(self, route: Route | None) -> str:
        """The worker for a request given blockd's answer (None: blockd was not asked or failed)."""
        chosen = choose_routed(route, self.addresses) if route is not None else None
        if chosen is not None:
            self.num_routed += 1
            return chosen
        self.num_round_robin += 1
        return self._round_robin.next()

    def failover_order(self, first: str) -> list[str]:
        """`first`, then every other worker in the client's order (tried when unreachable)."""
        return [first] + [a for a in self.addresses if a != first]

    def unknown_identities(self, tokenized: Tokenized | None, worker: str) -> list[str]:
        """Workers whose ModelInfo is needed to decide `prompt_for(.., tokenized, worker)`."""
        if tokenized is None or tokenized.worker_address == worker:
            return []
        return [a for a in (tokenized.worker_address, worker) if a not in self._identities]

    def learn(self, address: str, info: ModelInfo) -> None:
        self._identities[address] = tokenizer_identity(info)

    def prompt_for(self, prompt: Prompt, tokenized: Tokenized | None, worker: str) -> Prompt:
        """What Generate sends to `worker`: the routing token ids when its tokenizer is known to match."""
        if tokenized is None:
            return prompt
        if tokenized.worker_address != worker:
            mine = self._identities.get(tokenized.worker_address)
            if mine is None or mine != self._identities.get(worker):
                return prompt
        return tokenized.apply(prompt)

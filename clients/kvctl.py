"""kvctl: generate against, inspect and flush the prefix cache from a shell.

Human output is rich tables (at full width when stdout is not a terminal); `--json`
(global or per command) prints stable keys for scripts. A failed call prints one
line, "error: ...", in kvctl's words (commands and flags, not RPCs), and exits
non-zero: 1 the daemon refused the request, 2 bad usage (also a --blockd address
that serves computed, or the reverse), 3 a daemon is unreachable or too slow, 4 the
admin token is missing or wrong, 130 interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, update_wrapper
from pathlib import Path
from typing import Any

import click
import grpc
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from clients import render
from clients.client import DEFAULT_BLOCKD, DEFAULT_COMPUTED, GenerateStream, KVCacheClient
from clients.diagnose import check_address, explain_unimplemented, in_kvctl_words
from clients.errors import KVCacheError
from clients.options import ClientOptions, TlsOptions
from clients.prefix_tree import build_prefix_forest
from clients.requests import Prompt, SamplingParams
from clients.routing import ROUTING_MODES
from clients.types import BlockInfo, Completion, GenerateChunk, to_dict

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
_AUTH_HINT = "; pass --admin-token or set KVCACHE_ADMIN_TOKEN"


@dataclass(frozen=True)
class Settings:
    blockd: str
    computed: tuple[str, ...]
    routing: str
    options: ClientOptions
    as_json: bool


class Session:
    """What every command gets: the settings, a lazily opened client and the consoles."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.out = render.output_console()
        self.err = render.output_console(stderr=True)

    @cached_property
    def client(self) -> KVCacheClient:
        s = self.settings
        return KVCacheClient(s.blockd, s.computed, routing=s.routing, options=s.options)

    def close(self) -> None:
        if "client" in self.__dict__:
            self.client.close()

    def emit_json(self, value: Any) -> None:
        click.echo(json.dumps(value, indent=2, sort_keys=False))

    def progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=self.err,
            transient=True,
            disable=not self.err.is_terminal,
        )


class KvctlGroup(click.Group):
    """Turns client failures into one-line errors and exit codes instead of tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVCacheError as error:
            session = ctx.find_object(Session)
            swapped = explain_unimplemented(error, session.settings.options.tls if session else None)
            if swapped is not None:
                click.echo(f"error: {swapped}", err=True)
                ctx.exit(EXIT_USAGE)
            hint = _AUTH_HINT if error.is_auth else ""
            code = EXIT_AUTH if error.is_auth else EXIT_UNREACHABLE if error.is_unreachable else EXIT_REFUSED
            click.echo(f"error: {in_kvctl_words(str(error))}{hint}", err=True)
            ctx.exit(code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # `kvctl blocks | head`: the reader left; end quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)


def _split_addresses(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(a.strip() for v in values for a in v.replace(" ", ",").split(",") if a.strip())


def _checked(service: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """An option callback that refuses addresses without a port or with a URL scheme (exit 2)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        values = [value] if isinstance(value, str) else _split_addresses(value or ())
        try:
            for address in values:
                check_address(address, service)
        except ValueError as error:
            raise click.BadParameter(str(error), ctx, param) from None
        return value

    return callback


def parse_token_ids(value: str) -> list[int]:
    hint = "'--tokens'"
    try:
        token_ids = [int(t) for t in value.replace(" ", ",").split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated token ids, got {value!r}", param_hint=hint
        ) from None
    if not token_ids or any(t < 0 for t in token_ids):
        raise click.BadParameter("expected one or more token ids >= 0", param_hint=hint)
    return token_ids


_EPILOG = (
    "Each global option with an [env var: KVCACHE_...] can also be set by that environment "
    "variable; the option wins. Exit codes: 0 ok, 1 refused, 2 bad command line, 3 unreachable or "
    "deadline, 4 admin token missing or wrong, 130 interrupted."
)


@click.group(cls=KvctlGroup, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--blockd",
    envvar="KVCACHE_BLOCKD",
    show_envvar=True,
    default=DEFAULT_BLOCKD,
    show_default=True,
    callback=_checked("blockd"),
    help="blockd address, HOST:PORT.",
)
@click.option(
    "--computed",
    envvar="KVCACHE_COMPUTED",
    show_envvar=True,
    multiple=True,
    callback=_checked("computed"),
    help=f"computed address, HOST:PORT; repeat or comma-separate for several. [default: {DEFAULT_COMPUTED}]",
)
@click.option(
    "--admin-token", envvar="KVCACHE_ADMIN_TOKEN", show_envvar=True, default=None, help="blockd admin token."
)
@click.option(
    "--timeout",
    envvar="KVCACHE_TIMEOUT",
    show_envvar=True,
    type=click.FloatRange(min=0.001),
    default=None,
    help="Deadline of each call in seconds, retries included [default: 30; "
    "generate: 600 for the whole stream].",
)
@click.option(
    "--routing",
    type=click.Choice(ROUTING_MODES),
    default="cache-aware",
    show_default=True,
    help="How to pick among several computed addresses.",
)
@click.option(
    "--tls-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="KVCACHE_TLS_CA",
    show_envvar=True,
    help="Use TLS, trusting this CA certificate (PEM).",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="KVCACHE_TLS_CERT",
    show_envvar=True,
    help="Client certificate for mutual TLS (PEM).",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="KVCACHE_TLS_KEY",
    show_envvar=True,
    help="Client key for mutual TLS (PEM).",
)
@click.option(
    "--tls-server-name",
    envvar="KVCACHE_TLS_SERVER_NAME",
    show_envvar=True,
    help="Name to check the server certificate against.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def cli(
    ctx: click.Context,
    blockd: str,
    computed: tuple[str, ...],
    admin_token: str | None,
    timeout: float | None,
    routing: str,
    tls_ca: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_server_name: str | None,
    as_json: bool,
) -> None:
    """Inspect, flush and use the prefix-caching KV block service."""
    tls = None
    if tls_ca or tls_cert or tls_key or tls_server_name:
        try:
            tls = TlsOptions(tls_ca, tls_cert, tls_key, tls_server_name)
        except ValueError as error:
            raise click.UsageError(str(error)) from None
    deadlines = {"timeout": timeout, "generate_timeout": timeout} if timeout is not None else {}
    options = ClientOptions(tls=tls, admin_token=admin_token or None, **deadlines)
    settings = Settings(blockd, _split_addresses(computed) or (DEFAULT_COMPUTED,), routing, options, as_json)
    session = Session(settings)
    ctx.obj = session
    ctx.call_on_close(session.close)


def command(*args: Any, **kwargs: Any) -> Callable:
    """A kvctl subcommand that also accepts --json after its name and gets the Session."""

    def decorate(f: Callable) -> click.Command:
        def wrapper(as_json: bool, **params: Any) -> Any:
            session = click.get_current_context().find_object(Session)
            assert session is not None, "kvctl commands run under the cli group"
            return f(session, session.settings.as_json or as_json, **params)

        update_wrapper(wrapper, f)  # carries f's click params over
        wrapper = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(wrapper)
        return cli.command(*args, **kwargs)(wrapper)

    return decorate


def _prompt_options(f: Callable) -> Callable:
    for option in reversed(
        [
            click.argument("text", required=False),
            click.option("--tokens", "token_text", help="Token ids instead of text, e.g. 1,2,3."),
            click.option("--system", help="System message: TEXT becomes the user message of a chat."),
            click.option("--chat", is_flag=True, help="Render TEXT as a user chat message."),
            click.option("--salt", default="", help="Cache salt (tenant isolation)."),
            click.option(
                "--public-prefix-tokens",
                type=click.IntRange(min=0),
                default=0,
                help="Leading tokens shared by every salt.",
            ),
        ]
    ):
        f = option(f)
    return f


def _prompt(
    text: str | None,
    token_text: str | None,
    system: str | None,
    chat: bool,
    salt: str,
    public_prefix_tokens: int,
) -> Prompt:
    if (text is None) == (token_text is None):
        raise click.UsageError("give TEXT or --tokens (one of them)")
    if token_text is not None:
        return Prompt.of(
            token_ids=parse_token_ids(token_text), cache_salt=salt, public_prefix_tokens=public_prefix_tokens
        )
    if text == "-":
        text = sys.stdin.read()
    if not text:  # refused here, in kvctl's words, not by the daemon as an empty token list
        raise click.BadParameter(
            'the prompt is empty; give some text ("-" reads it from stdin) or --tokens',
            param_hint="'TEXT'",
        )
    if system is not None or chat:
        messages = ([("system", system)] if system is not None else []) + [("user", text)]
        return Prompt.of(messages=messages, cache_salt=salt, public_prefix_tokens=public_prefix_tokens)
    return Prompt.of(text, cache_salt=salt, public_prefix_tokens=public_prefix_tokens)


def _token_ids(session: Session, prompt: Prompt) -> list[int]:
    """The prompt's token ids for a blockd command; a text that tokenizes to nothing is a usage error."""
    token_ids = session.client.tokenize_prompt(prompt)
    if not token_ids:
        raise click.BadParameter("the prompt tokenized to no tokens; give some text", param_hint="'TEXT'")
    return token_ids


# ---------------------------------------------------------------- generation


@command("generate")
@_prompt_options
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Most tokens to generate (prompt + completion must fit the model's context).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sampling temperature; 0 is greedy.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=None,
    help="Nucleus sampling: sample from the smallest set of tokens whose probabilities add up "
    "to P (0 < P <= 1) [default: 1, off].",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=None,
    help="Sample from the K most likely tokens only [default: 0, off].",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=None,
    help="Random seed: the same seed, prompt and parameters give the same sample "
    "[default: none, a fresh one per request].",
)
@click.option("--stop", multiple=True, help="Stop when this string is generated (repeatable).")
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Keep generating past the model's end-of-sequence token, up to --max-tokens.",
)
@click.option(
    "--cache-policy",
    type=click.Choice(["store", "read_only", "none"]),
    default="store",
    show_default=True,
    help="store: reuse and store; read_only: reuse cached blocks but never store this request's "
    "new ones (a one-off); none: neither.",
)
@click.option(
    "--priority",
    type=click.IntRange(min=1, max=100),
    default=None,
    help="Retention priority of this request's blocks, 1-100 (eviction weighs it) [default: 35].",
)
def generate(
    session: Session,
    as_json: bool,
    text: str | None,
    token_text: str | None,
    system: str | None,
    chat: bool,
    salt: str,
    public_prefix_tokens: int,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    cache_policy: str,
    priority: int | None,
) -> None:
    """Generate from TEXT ("-" reads stdin), streaming the text; cached tokens and TTFT at the end."""
    prompt = dataclasses.replace(
        _prompt(text, token_text, system, chat, salt, public_prefix_tokens),
        cache_policy=cache_policy,
        retention_priority=priority or 0,
    )
    params = SamplingParams.of(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
    )
    stream = session.client.generate_prompt(prompt, params)
    chunks = []
    try:
        for chunk in stream:
            chunks.append(chunk)
            if not as_json and chunk.text:
                click.echo(chunk.text, nl=False)
    except KeyboardInterrupt:
        stream.cancel()
        raise
    except KVCacheError as error:
        if not chunks:
            raise
        _report_partial(session, as_json, stream, chunks, error)
    completion = Completion.from_chunks(chunks, stream.worker_address)
    if as_json:
        session.emit_json(completion.to_dict())
        return
    click.echo()
    session.err.print(render.usage_line(completion), soft_wrap=True)


def _report_partial(
    session: Session, as_json: bool, stream: GenerateStream, chunks: list[GenerateChunk], error: KVCacheError
) -> None:
    """The stream broke after text arrived: show what came, finish "timeout" (or "error"), exit 3/1.

    The usage the server sends with its last message never came, so the counts it
    alone knows (prompt and cached tokens, its timings) are null, not guessed.
    """
    finish = "timeout" if error.code is grpc.StatusCode.DEADLINE_EXCEEDED else "error"
    token_ids = [t for c in chunks for t in c.token_ids]
    if as_json:
        usage = {
            "prompt_tokens": None,
            "cached_tokens": None,
            "completion_tokens": len(token_ids),
            "time_to_first_token_seconds": None,
            "total_time_seconds": None,
            "num_preemptions": None,
        }
        session.emit_json(
            {
                "request_id": chunks[0].request_id,
                "text": "".join(c.text for c in chunks),
                "token_ids": token_ids,
                "finish_reason": finish,
                "usage": usage,
                "worker_address": stream.worker_address,
                "error": str(error),
            }
        )
    else:
        click.echo()
    if finish == "timeout":
        what = f"the deadline of {session.settings.options.generate_timeout:g} s (--timeout) expired"
    else:
        what = f"the stream broke ({error.details or 'no details'})"
    click.echo(
        f"error: {error.service} at {error.address}: {what} after "
        f"{render.plural(len(token_ids), 'completion token')} ({error.code.name}); the text "
        f"{'in the JSON' if as_json else 'above'} is partial (finish_reason {finish})",
        err=True,
    )
    click.get_current_context().exit(EXIT_UNREACHABLE if error.is_unreachable else EXIT_REFUSED)


@command("route")
@_prompt_options
def route(session: Session, as_json: bool, **prompt_args: Any) -> None:
    """Which computed holds the longest cached prefix of TEXT (blockd's RoutingService)."""
    prompt = _prompt(**prompt_args)
    token_ids = _token_ids(session, prompt)
    answer = session.client.blockd.route(
        token_ids, cache_salt=prompt.cache_salt, public_prefix_tokens=prompt.public_prefix_tokens
    )
    if as_json:
        session.emit_json({"num_tokens": len(token_ids), **to_dict(answer)})
        return
    where = answer.worker_address or "no live pool"
    session.out.print(f"route: {where} ({answer.num_cached_tokens} of {len(token_ids)} tokens cached)")
    session.out.print(render.lookup_table(answer.candidates, len(token_ids)))


@command("info")
def info(session: Session, as_json: bool) -> None:
    """Model and pool of each computed."""
    infos = {a: session.client.computed(a).model_info() for a in session.client.computed_addresses}
    if as_json:
        session.emit_json({"workers": [{"address": a, **to_dict(i)} for a, i in infos.items()]})
        return
    for address, model in infos.items():
        session.out.print(f"[bold]{address}[/]")
        for key, value in to_dict(model).items():
            session.out.print(f"  {key:<20} {value}", markup=False)


# ---------------------------------------------------------------- operators


@command("stats")
@click.option("--pool", help="One pool instead of all.")
def stats(session: Session, as_json: bool, pool: str | None) -> None:
    """Block and prefix-cache counters (totals and per pool)."""
    result = session.client.blockd.get_stats(pool)
    if as_json:
        session.emit_json(
            {
                **to_dict(result.total),
                "hit_rate": result.total.hit_rate,
                "last_event_sequence": result.last_event_sequence,
                "pools": [to_dict(p) for p in result.pools],
            }
        )
        return
    session.out.print(render.stats_table(result))


@command("pools")
def pools(session: Session, as_json: bool) -> None:
    """Registered pools: worker, namespace, lease and counters."""
    result = session.client.blockd.list_pools()
    if as_json:
        session.emit_json({"pools": [to_dict(p) for p in result]})
        return
    session.out.print(render.pools_table(result))


def _fetch_blocks(session: Session, pool: str | None) -> list[BlockInfo]:
    blockd = session.client.blockd
    total = blockd.get_stats(pool).total.num_cached_blocks
    blocks = []
    with session.progress() as progress:
        task = progress.add_task("reading blocks", total=total or None)
        for block in blockd.iter_blocks(pool):
            blocks.append(block)
            progress.advance(task)
    return blocks


@command("blocks")
@click.option("--pool", help="One pool instead of all.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=200,
    show_default=True,
    help="Rows in the table (0: all); --json always lists all.",
)
def blocks(session: Session, as_json: bool, pool: str | None, limit: int) -> None:
    """Cached blocks with hashes, parents, references and tokens."""
    result = _fetch_blocks(session, pool)
    if as_json:
        session.emit_json({"blocks": [to_dict(b) for b in result]})
        return
    shown = result[:limit] if limit else result
    session.out.print(render.blocks_table(shown, len(result)))


@command("tree")
@click.option("--pool", help="One pool instead of all.")
@click.option("--token-ids", "show_ids", is_flag=True, help="Show token ids, do not decode.")
def tree(session: Session, as_json: bool, pool: str | None, show_ids: bool) -> None:
    """Cached prefixes as a tree (parent links), runs decoded to text via computed."""
    forest = build_prefix_forest(_fetch_blocks(session, pool))
    if not show_ids:
        _decode_runs(session, forest)
    if as_json:
        session.emit_json(
            {"pools": [{"pool_id": p, "roots": [n.to_dict() for n in roots]} for p, roots in forest.items()]}
        )
        return
    sizes = {p.pool_id: p.block_size for p in session.client.blockd.list_pools()}
    session.out.print(render.prefix_tree(forest, sizes))


def _decode_runs(session: Session, forest: dict) -> None:
    """Fills node.text via Detokenize; leaves token ids when no computed answers."""
    computed = session.client.computed()
    nodes = [n for roots in forest.values() for root in roots for n in root.walk()]
    try:
        for node in nodes:
            node.text = computed.detokenize(node.token_ids)
    except KVCacheError as error:
        if not error.is_unreachable:
            raise
        for node in nodes:
            node.text = None
        session.err.print(f"note: showing token ids; {error}", markup=False)


@command("lookup")
@_prompt_options
@click.option("--pool", help="One pool instead of all.")
def lookup(session: Session, as_json: bool, pool: str | None, **prompt_args: Any) -> None:
    """How many leading tokens of TEXT (or --tokens) each pool has cached."""
    prompt = _prompt(**prompt_args)
    token_ids = _token_ids(session, prompt)
    matches = session.client.blockd.lookup(
        token_ids,
        cache_salt=prompt.cache_salt,
        public_prefix_tokens=prompt.public_prefix_tokens,
        pool_id=pool,
    )
    if as_json:
        session.emit_json({"num_tokens": len(token_ids), "matches": [to_dict(m) for m in matches]})
        return
    session.out.print(render.lookup_table(matches, len(token_ids)))


@command("flush")
@click.option("--pool", help="Only this pool.")
@click.option("--salt", help="Only blocks whose chain carries this cache salt.")
@click.option(
    "--tier", type=click.Choice(["device", "host", "shared"]), help="Only this tier (default: every tier)."
)
def flush(session: Session, as_json: bool, pool: str | None, salt: str | None, tier: str | None) -> None:
    """Drop every unreferenced cached block; referenced ones are reported busy."""
    result = session.client.blockd.flush(pool_id=pool, cache_salt=salt, tier=tier)
    tiered = set(result.tiers) - {"device"}  # without lower tiers, the output stays as it was
    if as_json:
        answer = {"dropped": result.dropped, "busy": result.busy}
        session.emit_json({**answer, "tiers": result.tiers} if tiered else answer)
        return
    per_tier = (
        ""
        if not tiered
        else "".join(
            f"; {name}: {dropped:,} dropped, {busy:,} busy" for name, (dropped, busy) in result.tiers.items()
        )
    )
    session.out.print(
        f"flushed: dropped {render.plural(result.dropped, 'cached block')}; "
        f"{result.busy:,} busy (still referenced, left in place){per_tier}"
    )


@command("pin")
@_prompt_options
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, max=30 * 86400),
    default=3600.0,
    show_default=True,
    help="Seconds the pin lasts.",
)
@click.option("--pool", help="Only this pool.")
def pin(session: Session, as_json: bool, ttl: float, pool: str | None, **prompt_args: Any) -> None:
    """Keep the cached prefix of TEXT (or --tokens) from eviction for --ttl seconds."""
    prompt = _prompt(**prompt_args)
    token_ids = _token_ids(session, prompt)
    result = session.client.blockd.pin(
        token_ids,
        cache_salt=prompt.cache_salt,
        public_prefix_tokens=prompt.public_prefix_tokens,
        ttl_seconds=ttl,
        pool_id=pool,
    )
    if result.num_pinned_blocks == 0:  # blockd answers an empty pin: drop it, and say why
        session.client.blockd.unpin(result.pin_id)
        where = f"pool {pool!r}" if pool else "any live pool"
        click.echo(
            f"error: no block of this prompt is cached in {where}, so there is nothing to pin; "
            "send it once (kvctl generate), then pin it (kvctl why explains a miss)",
            err=True,
        )
        click.get_current_context().exit(EXIT_REFUSED)
    if as_json:
        session.emit_json(to_dict(result))
        return
    session.out.print(render.pin_text(result))


@command("unpin")
@click.argument("pin_id", required=False)
@click.option("--all", "unpin_all", is_flag=True, help="Release every pin.")
def unpin(session: Session, as_json: bool, pin_id: str | None, unpin_all: bool) -> None:
    """Release a pin made by `kvctl pin` (or every pin with --all)."""
    if (pin_id is None) == (not unpin_all):
        raise click.UsageError("give PIN_ID or --all (one of them)")
    if unpin_all:
        num_pins, num_unpinned = session.client.blockd.unpin_all()
        if as_json:
            session.emit_json({"num_unpinned_pins": num_pins, "num_unpinned_blocks": num_unpinned})
            return
        session.out.print(
            f"unpinned {render.plural(num_pins, 'pin')} ({render.plural(num_unpinned, 'block')})"
        )
        return
    num_unpinned = session.client.blockd.unpin(pin_id)
    if as_json:
        session.emit_json({"pin_id": pin_id, "num_unpinned_blocks": num_unpinned})
        return
    session.out.print(f"unpinned {render.plural(num_unpinned, 'block')}")


@command("why")
@_prompt_options
@click.option("--pool", help="One pool instead of all.")
def why(session: Session, as_json: bool, pool: str | None, **prompt_args: Any) -> None:
    """Why TEXT (or --tokens) is not (fully) cached: per pool, the cached prefix, then the
    reason of the first missing block (never seen, evicted by which policy and when,
    flushed, not stored, other salt, other model) and the partial tail."""
    prompt = _prompt(**prompt_args)
    token_ids = _token_ids(session, prompt)
    explanations = session.client.blockd.explain_miss(
        token_ids,
        cache_salt=prompt.cache_salt,
        public_prefix_tokens=prompt.public_prefix_tokens,
        pool_id=pool,
    )
    if as_json:
        session.emit_json({"num_tokens": len(token_ids), "pools": [to_dict(e) for e in explanations]})
        return
    session.out.print(render.why_text(explanations, len(token_ids)))


@command("watch")
@click.option("--pool", help="Only this pool.")
@click.option(
    "--after",
    "after_sequence",
    type=click.IntRange(min=0),
    default=None,
    help="Replay the retained events after this sequence number first (0: all of them) "
    "[default: none, only new events].",
)
def watch(session: Session, as_json: bool, pool: str | None, after_sequence: int | None) -> None:
    """Print block events (stored / removed / cleared / gap / demoted / loaded) as they happen;
    Ctrl-C stops (exit 130)."""
    blockd = session.client.blockd
    if after_sequence is None:
        after_sequence = blockd.get_stats(pool).last_event_sequence
    try:
        for event in blockd.watch_events(after_sequence, pool_id=pool):
            if as_json:
                click.echo(json.dumps(to_dict(event)))
            else:
                session.out.print(render.event_line(event), markup=False, soft_wrap=True)
    except KeyboardInterrupt:  # the normal way to stop watching: no error line, but exit 130
        click.get_current_context().exit(EXIT_INTERRUPTED)


def main(argv: Sequence[str] | None = None) -> None:
    cli.main(args=list(argv) if argv is not None else None, prog_name="kvctl")


if __name__ == "__main__":
    main()

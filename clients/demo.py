"""`make demo`: start the stack on the built-in model and watch the prefix cache work.

Sends a workload of chat requests that share one system prompt and ask different
questions, one after another. The first request computes the system prompt's K/V;
every later one finds its full blocks in the cache, so its prefill (and its time to
first token) covers only the question. A last request shows the cold cost again:
after a flush when the demo started the stack itself, under a fresh cache salt when
it reuses a running one. Cold and warm are what each request measured (cold: 0
cached tokens); the hit rates count this run's requests only.

The stack is stopped at the end, also on errors and Ctrl-C (--keep leaves it
running). A stack already running from --run-dir (`make up`) is reused and left
alone: not flushed, not stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from statistics import median

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from clients.client import KVCacheClient
from clients.errors import KVCacheError
from clients.options import ClientOptions
from clients.render import percent, preview_text
from clients.stack import Stack, StackError, kvctl_command, python_command
from clients.types import ChatMessage, Completion, PoolStats

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Cloud, a company that rents GPU servers by the hour. "
    "Answer in one or two short sentences, politely and precisely. Plans: Starter (one GPU, 24 GB), "
    "Team (four GPUs, 80 GB each, shared storage) and Enterprise (dedicated racks, private network). "
    "Billing is per second with a one-minute minimum; invoices go out on the first day of the month. "
    "Support answers within one hour on Team and within ten minutes on Enterprise. Never invent prices."
)

QUESTIONS = (
    "How is usage billed?",
    "Which plan has dedicated racks?",
    "How fast does support answer on the Team plan?",
    "When are invoices sent?",
    "How much memory does the Starter GPU have?",
    "Can several people share storage?",
    "Is there a minimum billing time?",
    "What does the Enterprise plan include?",
    "How many GPUs come with the Team plan?",
    "Do you offer a private network?",
    "What is the fastest support response time?",
    "Which plan should a solo researcher pick?",
    "Is billing per hour or per second?",
    "Where can I see my invoice?",
    "What GPU memory does the Team plan offer?",
    "Can I upgrade from Starter to Team?",
)


def build_messages(question: str) -> list[ChatMessage]:
    return [ChatMessage("system", SYSTEM_PROMPT), ChatMessage("user", question)]


def run_workload(
    client: KVCacheClient, questions: Sequence[str], max_tokens: int, console: Console
) -> list[tuple[str, Completion]]:
    """Sends the questions one by one, showing a live table and a progress bar."""
    table = _results_table()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("requests", total=len(questions))
    results = []
    with Live(Group(table, progress), console=console, refresh_per_second=8):
        for i, question in enumerate(questions, start=1):
            completion = client.complete(messages=build_messages(question), max_tokens=max_tokens)
            results.append((question, completion))
            _add_row(table, str(i), question, completion)
            progress.advance(task)
    if not console.is_terminal:
        console.line()  # a live display that never animated ends mid-line
    return results


def _results_table() -> Table:
    table = Table(title="shared system prompt, different questions", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True, min_width=2)
    table.add_column("question", no_wrap=True, overflow="ellipsis", min_width=12, max_width=24)
    for name, width in (("prompt", 6), ("cached", 6), ("hit", 6), ("TTFT ms", 7)):
        table.add_column(name, justify="right", no_wrap=True, min_width=width)
    table.add_column("answer", no_wrap=True, overflow="ellipsis", min_width=8, max_width=14)
    return table


def _add_row(table: Table, label: str, question: str, completion: Completion) -> None:
    u = completion.usage
    style = "green" if u.cached_tokens else "yellow"
    table.add_row(
        label,
        Text(question),
        str(u.prompt_tokens),
        Text(str(u.cached_tokens), style=style),
        percent(u.cached_tokens, u.prompt_tokens),
        f"{1000 * u.time_to_first_token_seconds:.1f}",
        Text(preview_text(completion.text, 36)),
    )


def summarize(results: list[tuple[str, Completion]], console: Console) -> None:
    """This run's hit rate and TTFT, cold (0 cached tokens) against warm, as measured."""
    usages = [c.usage for _, c in results]
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    console.print(
        f"[bold]hit rate of this run:[/] {cached:,} of {prompt:,} prompt tokens served from cache "
        f"([bold green]{percent(cached, prompt)}[/])"
    )
    cold = [u.time_to_first_token_seconds for u in usages if u.cached_tokens == 0]
    warm = [u.time_to_first_token_seconds for u in usages if u.cached_tokens > 0]
    if cold and warm:
        console.print(f"TTFT: cold (0 cached tokens) {_ms(cold)}, warm (prefix cached) {_ms(warm)}")
    elif warm:
        console.print(
            f"TTFT: every request found its prefix cached (the stack had the system prompt "
            f"already): {_ms(warm)}; the cold request below shows the difference"
        )
    elif cold:
        console.print(f"TTFT: no request found a cached prefix: {_ms(cold)}")


def _ms(seconds: Sequence[float]) -> str:
    """ "12.3 ms" for one value, "median 12.3 ms of 15 requests" for several."""
    if len(seconds) == 1:
        return f"{1000 * seconds[0]:.1f} ms"
    return f"median {1000 * median(seconds):.1f} ms of {len(seconds)} requests"


def cold_request(client: KVCacheClient, started: bool, max_tokens: int) -> tuple[str, Completion]:
    """The first question again, with nothing cached for it; returns how, and the completion.

    A stack the demo started is flushed (like `kvctl flush`); a stack it reuses is
    someone's cache and stays untouched: a fresh cache salt changes every block's
    hash, so the same prompt misses without dropping anything.
    """
    messages = build_messages(QUESTIONS[0])
    if started:
        flushed = client.blockd.flush()
        how = f"after a flush ({flushed.dropped:,} blocks dropped, {flushed.busy:,} busy)"
        return how, client.complete(messages=messages, max_tokens=max_tokens)
    salt = f"demo-{uuid.uuid4().hex}"
    how = "under a fresh cache salt (the running stack is not flushed)"
    return how, client.complete(messages=messages, max_tokens=max_tokens, cache_salt=salt)


def blockd_line(before: PoolStats, after: PoolStats) -> str:
    """blockd's own count of this run's hits: the difference of its counters before and after."""
    queried = max(0, after.queried_tokens - before.queried_tokens)
    hits = max(0, after.hit_tokens - before.hit_tokens)
    return (
        f"blockd counted {hits:,} of {queried:,} prompt tokens admitted during this run as hits "
        f"({percent(hits, queried)})"
    )


def _next_step(blockd: str, computed: Sequence[str], stays_up: bool) -> str:
    """What to run next, spelled to work as printed (the venv's kvctl, the stack's addresses)."""
    if stays_up:
        return f"`{kvctl_command('--blockd', blockd, '--computed', ','.join(computed), 'tree')}`"
    return f"`make up`, then `make demo` (it reuses a running stack) and `{kvctl_command('tree')}`"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=python_command("-m", "clients.demo"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", type=Path, default=Path("run"))
    parser.add_argument("--blockd", default="127.0.0.1:50051")
    parser.add_argument("--computed", action="append", default=None, help="repeat for several workers")
    parser.add_argument("--model", help="model directory (default: computed's built-in model)")
    parser.add_argument(
        "--requests",
        type=int,
        default=len(QUESTIONS),
        choices=range(1, len(QUESTIONS) + 1),
        metavar=f"1..{len(QUESTIONS)}",
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    parser.add_argument("--gateway", help="also start the OpenAI-compatible HTTP gateway on this HOST:PORT")
    return parser


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(stack: Stack, console: Console) -> bool:
    """Stop what this run started, to the end even when Ctrl-C comes meanwhile (a stop cut
    short leaves daemons running); True when one came. (A short run can be stopping already
    when the user presses it.)"""
    interrupted = False
    while True:
        try:
            with console.status("stopping the stack..."):
                stack.down()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` cleans up like Ctrl-C
    stack = Stack(args.run_dir)
    started = False
    try:
        addresses = stack.addresses()
        if "blockd" in addresses:
            console.print(
                f"using the stack already running from {args.run_dir}; its cache is left alone "
                f"(no flush) and it keeps running"
            )
        else:
            with console.status("starting valkey, blockd and computed (loading the model)..."):
                stack.up(
                    args.blockd, args.computed or ["127.0.0.1:50052"], model=args.model, gateway=args.gateway
                )
            started = True
            for note in stack.notes:
                console.print(note, markup=False)
            addresses = stack.addresses()
        computed = [a for name, a in sorted(addresses.items()) if name.startswith("computed")]
        token = os.environ.get("KVCACHE_ADMIN_TOKEN") or os.environ.get("BLOCKD_ADMIN_TOKEN")
        options = ClientOptions(admin_token=token or None)
        with KVCacheClient(addresses["blockd"], computed, options=options) as client:
            before = client.blockd.get_stats().total
            info = client.computed().model_info()
            console.print(
                f"model [bold]{info.model_id}[/] ({info.architecture}, {info.dtype} on {info.device}), "
                f"block size {info.block_size}, {info.num_blocks} blocks; workers: {', '.join(computed)}"
            )
            if info.model_id == "default_model":
                console.print(
                    "(the built-in model is tiny and writes Python-like text: its answers are noise; "
                    "the point here is the cache)",
                    style="dim",
                )
            results = run_workload(client, QUESTIONS[: args.requests], args.max_tokens, console)
            summarize(results, console)
            how, again = cold_request(client, started, args.max_tokens)
            label = "cold" if again.usage.cached_tokens == 0 else "not cold"
            console.print(
                f"the first question again {how}: cached {again.usage.cached_tokens} tokens "
                f"({label}), TTFT {1000 * again.usage.time_to_first_token_seconds:.1f} ms"
            )
            console.print(blockd_line(before, client.blockd.get_stats().total))
            console.print(
                f"try: {_next_step(addresses['blockd'], computed, stays_up=not started or args.keep)}",
                markup=False,
            )
            if "gateway" in addresses:
                console.print(
                    f"OpenAI-compatible API: http://{addresses['gateway']}/v1 (see README)", markup=False
                )
        return 0
    except (StackError, KVCacheError) as error:
        console.print(f"error: {error}", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    finally:
        if started and not args.keep and _stop(stack, console):
            console.print("interrupted")
            raise SystemExit(130)


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: start the stack on the built-in model and watch the prefix cache work.

Sends a workload of chat requests that share one system prompt and ask different
questions, one after another. The first request computes the system prompt's K/V;
every later one finds its full blocks in the cache, so its prefill (and its time to
first token) covers only the question. A last request shows the cold cost again:
after a flush when the demo started the stack itself, under a fresh cache salt when
it reuses a running one. Cold and warm are what each request measured (cold: 0
cached tokens); the hit rate counts this run's requests only (their usage).

The stack is stopped at the end, also on errors and Ctrl-C (--keep leaves it
running). A stack already running from --run-dir (`make up`) is reused and left
alone: not flushed, not stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
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
from clients.types import ChatMessage, Completion

# The shared prefix: a support handbook, about 1,500 tokens of the built-in model's tokenizer,
# long enough that its prefill clearly outweighs the question's (a cold request computes it
# all; a warm one finds its full blocks cached and computes only the question).
SYSTEM_PROMPT = """You are the support assistant of Northwind Cloud, a company that rents GPU servers by the hour.
Answer in one or two short sentences, politely and precisely, using only the handbook below. Never invent prices.

# Plans
- Starter: one GPU with 24 GB of memory, 8 virtual CPUs, 64 GB of RAM and 500 GB of local NVMe storage.
- Team: four GPUs with 80 GB each, 64 virtual CPUs, 512 GB of RAM, 4 TB of NVMe and shared network storage.
- Enterprise: dedicated racks, a private network, a named account manager and custom hardware on request.
- Every plan includes a public IPv4 address, an IPv6 range, snapshots and a web console.
- Upgrades from Starter to Team take effect at once and keep the disks; downgrades take effect at the next
  billing cycle, after the customer has moved any data that does not fit the smaller plan.

# Billing
- Usage is billed per second with a one-minute minimum for each server start.
- Invoices go out on the first day of each month and list every server, its plan and its running seconds.
- Invoices can be downloaded from the console under Account, then Billing, then Invoices.
- Payment is by card or, for Enterprise, by bank transfer within thirty days.
- A stopped server costs nothing for its GPUs but its disks are billed per gigabyte and month.
- Credits from the free trial expire after thirty days and cannot be moved to another account.

# Support
- Support answers within one hour on Team and within ten minutes on Enterprise, at any hour.
- Starter support answers within one business day, by email only.
- Outages are posted on the status page before support answers any ticket about them.
- Support never asks for a password, an API key or a card number; report such requests as phishing.

# Storage
- Local NVMe disks are erased when a server is deleted; snapshots are kept until the customer deletes them.
- Shared network storage on Team is mounted at /shared on every server of the team and is backed up daily.
- Backups are kept for fourteen days; restoring one takes about ten minutes per terabyte.
- Object storage is available on every plan through an S3-compatible API at the same per-gigabyte price.

# Networking
- Every server gets 10 Gbit/s of public bandwidth; traffic in is free, traffic out is free up to 10 TB a month.
- Enterprise racks connect through a private network of 100 Gbit/s per rack, isolated from other customers.
- Firewalls are configured in the console; by default only SSH on port 22 is open.
- Load balancers cost a flat monthly fee and forward HTTP, HTTPS and TCP.

# Accounts and security
- Accounts can have several users; the owner grants each one a role: viewer, operator or admin.
- Two-factor authentication is required for admins and recommended for everyone else.
- API keys are created per user, can be limited to read-only access, and can be revoked at any time.
- Audit logs keep every console and API action for one year.

# Data centers
- Data centers are in Frankfurt, Amsterdam, Virginia and Oregon; Enterprise racks are also offered in Tokyo.
- A server stays in the data center where it was created; snapshots can be copied to another one.
- Every data center runs on renewable energy and is certified ISO 27001.

# Hardware
- Starter GPUs are of the previous generation; Team and Enterprise GPUs are of the current generation.
- GPUs are never shared between customers; each server has its GPUs alone.
- Drivers and CUDA come preinstalled on the standard images; custom images may bring their own.

# Cancellation
- Servers can be deleted at any time; billing stops the second they are deleted.
- Enterprise contracts run for twelve months and renew unless cancelled sixty days before the end.
"""

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
        _wait_released(client)
        flushed = client.blockd.flush()
        how = f"after a flush ({flushed.dropped:,} blocks dropped, {flushed.busy:,} busy)"
        return how, client.complete(messages=messages, max_tokens=max_tokens)
    salt = f"demo-{uuid.uuid4().hex}"
    how = "under a fresh cache salt (the running stack is not flushed)"
    return how, client.complete(messages=messages, max_tokens=max_tokens, cache_salt=salt)


def _wait_released(client: KVCacheClient, timeout: float = 5.0) -> None:
    """Until the workload's sequences are released (a worker releases a finished request's
    blocks a step after its last token): a flush leaves referenced blocks in place, and the
    cold request would hit them."""
    deadline = time.monotonic() + timeout
    while client.blockd.get_stats().total.num_sequences and time.monotonic() < deadline:
        time.sleep(0.02)


def speedup_line(results: Sequence[tuple[str, Completion]], again: Completion) -> str | None:
    """Warm against cold on the same prompt length: the cold rerun against the warm median."""
    warm = [c.usage.time_to_first_token_seconds for _, c in results if c.usage.cached_tokens > 0]
    cold = again.usage.time_to_first_token_seconds
    if not warm or again.usage.cached_tokens or cold <= 0:
        return None
    ratio = cold / median(warm)
    return (
        f"cached prefix: time to first token {1000 * median(warm):.1f} ms warm against {1000 * cold:.1f} ms "
        f"cold, {ratio:.1f}x {'faster' if ratio >= 1 else 'slower'}"
    )


def next_steps(addresses: dict[str, str], computed: Sequence[str], stays_up: bool) -> list[str]:
    """What to run next, spelled to work as printed, and only what still runs."""
    if not stays_up:
        stopped = (
            "the demo's stack is stopped. To keep one running: `make up` (blockd, computed, and the "
            "OpenAI-compatible gateway on http://127.0.0.1:8000/v1), then `make demo` reuses it"
        )
        return [stopped]
    lines = [
        f"try: `{kvctl_command('--blockd', addresses['blockd'], '--computed', ','.join(computed), 'tree')}`"
    ]
    if "gateway" in addresses:
        lines.append(f"OpenAI-compatible API: http://{addresses['gateway']}/v1 (see README)")
    return lines


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
            speedup = speedup_line(results, again)
            if speedup:
                console.print(f"[bold]{speedup}[/]")
            for line in next_steps(addresses, computed, stays_up=not started or args.keep):
                console.print(line, markup=False)
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

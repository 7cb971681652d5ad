"""`scopewire status`: one screen of a live server's figures, read from its
/metrics (two scrapes `interval` seconds apart give the rates)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

SEND_OPS = ("message.send", "thread.reply", "message.forward")


class StatusError(Exception):
    """The server could not be scraped; the message is one line for humans."""


def scrape(url: str, timeout: float = 5.0) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted label pairs: value}} from `url`/metrics."""
    target = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:  # noqa: S310 - an operator's own URL
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        raise StatusError(f"{target} answered HTTP {error.code}"
                          + (" (metrics on --metrics-port? pass that port)" if error.code == 404 else "")) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise StatusError(f"cannot reach {target}: {reason}") from None
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _total(samples: dict, name: str, **match: str) -> float | None:
    values = [value for labels, value in samples.get(name, {}).items()
              if all(dict(labels).get(k) == v for k, v in match.items())]
    return sum(values) if values else None


def figures(first: dict, second: dict, seconds: float) -> dict:
    def rate(name: str, **match: str) -> float | None:
        # A counter with no samples yet has counted nothing.
        a, b = _total(first, name, **match) or 0.0, _total(second, name, **match) or 0.0
        return round(max(b - a, 0.0) / seconds, 1)

    def sends(samples: dict) -> float:
        return sum(_total(samples, "scopewire_commands_total", op=op, outcome="ok") or 0.0 for op in SEND_OPS)

    def number(name: str, **match: str) -> int | None:
        value = _total(second, name, **match)
        return None if value is None else int(value)

    return {
        "connections": {state: number("scopewire_connections", state=state)
                        for state in ("authenticated", "unauthenticated", "handshaking", "http")},
        "active_actors": number("scopewire_actors_active"),
        "sends_per_second": round(max(sends(second) - sends(first), 0.0) / seconds, 1),
        "deliveries_per_second": rate("scopewire_fanout_deliveries_total"),
        "commands_per_second": rate("scopewire_commands_total"),
        "errors_per_second": round((rate("scopewire_commands_total") or 0.0)
                                   - (rate("scopewire_commands_total", outcome="ok") or 0.0), 1),
        "outbox_backlog": number("scopewire_outbox_backlog"),
        "actor_mailbox_depth": number("scopewire_actor_mailbox_depth"),
        "bridge_queue_depth": number("scopewire_bridge_queue_depth"),
        "db_pool_in_use": number("scopewire_db_pool_connections", state="in_use"),
        "slow_consumer_closes": number("scopewire_slow_consumer_closes_total"),
        "interval_seconds": round(seconds, 2),
    }


def collect(url: str, interval: float) -> dict:
    first = scrape(url)
    started = time.monotonic()
    time.sleep(interval)
    second = scrape(url)
    return figures(first, second, max(time.monotonic() - started, 1e-3))


def render(url: str, data: dict) -> str:
    def show(value: object) -> str:
        return "?" if value is None else str(value)

    c = data["connections"]
    return "\n".join([
        f"scopewire at {url}",
        f"  connections       {show(c['authenticated'])} authenticated, {show(c['unauthenticated'])} "
        f"unauthenticated, {show(c['handshaking'])} handshaking, {show(c['http'])} plain HTTP",
        f"  active actors     {show(data['active_actors'])} (mailboxes: {show(data['actor_mailbox_depth'])} waiting)",
        f"  sends/s           {show(data['sends_per_second'])}",
        f"  deliveries/s      {show(data['deliveries_per_second'])}",
        f"  commands/s        {show(data['commands_per_second'])} ({show(data['errors_per_second'])} errors/s)",
        f"  outbox backlog    {show(data['outbox_backlog'])}",
        f"  database          {show(data['db_pool_in_use'])} pool connections in use, "
        f"{show(data['bridge_queue_depth'])} units in flight",
        f"  slow consumers    {show(data['slow_consumer_closes'])} cut off since start",
    ])


def main(url: str, interval: float, as_json: bool) -> int:
    data = collect(url, interval)
    print(json.dumps(data, indent=2) if as_json else render(url, data))
    return 0

"""Reading a monitor as Prometheus and the page do (tests/monitor/): ``/metrics`` parsed with
prometheus-client's own parser, ``/api/stats`` as JSON."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(monitor) -> dict[str, list]:
    """``{sample name: [(labels, value), ...]}`` of one scrape of ``/metrics``."""
    text = urllib.request.urlopen(monitor.url + "metrics", timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """The one sample of ``name`` with ``labels`` (fails if none or several)."""
    found = [v for sample_labels, v in samples[name] if all(sample_labels.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, samples[name])
    return found[0]


def api_stats(monitor, since: int = 0) -> dict:
    return json.loads(urllib.request.urlopen(f"{monitor.url}api/stats?since={since}", timeout=10).read())

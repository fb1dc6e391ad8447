"""What ``validate`` and ``test`` return and print: the epoch's metrics split by evaluation loader
(Lightning's rule for which keys each loader's dict holds) and the table of them."""

from __future__ import annotations

import re
from typing import Any

from trainer.stage_metrics import MetricSpec


def split_by_dataloader(values: dict[str, float], count: int,
                        specs: dict[str, MetricSpec] | None = None) -> list[dict[str, float]]:
    """One dict per evaluation loader, as ``validate``/``test`` return them (Lightning's rule): the keys
    logged while loader N ran (which end in "/dataloader_idx_N" unless logged with add_dataloader_idx=False)
    in dict N, and the keys logged outside the loaders (``on_validation_epoch_end``) in every dict."""
    if count == 1:
        return [values]
    pattern = re.compile(r"/dataloader_idx_(\d+)$")
    results: list[dict[str, float]] = [{} for _ in range(count)]
    for key, value in values.items():
        spec, match = (specs or {}).get(key), pattern.search(key)
        owner = spec.dataloader_idx if spec is not None else int(match.group(1)) if match else None
        for index, result in enumerate(results):
            if owner is None or owner == index:
                result[key] = value
    return results


def format_results(results: list[dict[str, float]] | Any, stage: str) -> str:
    """The metrics ``validate``/``test`` return, as a table with one column per loader."""
    if not isinstance(results, list) or not any(isinstance(result, dict) and result for result in results):
        return ""
    names = sorted({re.sub(r"/dataloader_idx_\d+$", "", key) for result in results for key in result})
    title = "Validate metric" if stage == "validate" else f"{stage.capitalize()} metric"
    width = max(len(title), *(len(name) for name in names)) + 2
    lines = [title.ljust(width) + "".join(f"DataLoader {index}".rjust(16) for index in range(len(results)))]
    for name in names:
        cells = []
        for index, result in enumerate(results):
            value = result.get(name, result.get(f"{name}/dataloader_idx_{index}"))
            cells.append(("" if value is None else f"{value:.6g}").rjust(16))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)

"""The loaders as a stage runs them: prepared for the strategy (sharded, seeded, limited), counted,
reloaded every ``reload_dataloaders_every_n_epochs``, and an epoch's training batches, resumed
mid-epoch.

Where the loaders come from is ``trainer/data_source.py``; what preparing one does is
``trainer/data.py``; resuming at the index level is ``trainer/resume.py``. These functions put
them together for the Trainer and return them with their counts (``num_training_batches``,
``num_val_batches``, ...), once per stage or epoch. When the training loop reloads them and when
it validates (``val_check_interval``, ``check_val_every_n_epoch``, as in Lightning) are decided
here too, and which limit ends fit (:func:`limit_reached`); ``ValidationSchedule.due`` is the only
function here that runs per batch.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from callbacks.console import info, MisconfigurationException, PossibleUserWarning, warn
from strategies.loaders import recording_batch_indices
from strategies.transfer import move_to_device
from trainer.batch_transfer import BatchTransfer, transferred
from trainer.combined_loader import CombinedLoader
from trainer.data import default_max_epochs, loader_length, prepare_loader, set_sampler_epoch
from trainer.preemption import iterate_shielded
from trainer.resume import resharded, resumable, resume_iterator

if TYPE_CHECKING:
    from trainer.data_source import DataSource
    from trainer.resume import ResumableBatchSampler
    from trainer.state import Progress
    from trainer.trainer import Trainer

#: The attribute holding each evaluation stage's batches per loader (Lightning's names).
NUM_BATCHES = {"validate": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}


def one_or_list(loaders: list[Any] | None) -> Any:
    """``trainer.val_dataloaders`` and the like, as Lightning gives them: the loader, or a list of several
    (a CombinedLoader's collection)."""
    if loaders is None or len(loaders) != 1:
        return loaders
    return loaders[0].iterables if isinstance(loaders[0], CombinedLoader) else loaders[0]


def prepare_stage_loader(trainer: Trainer, loader: Any, stage: str, shuffle: bool,
                         seed_offset: int = 0) -> tuple[Any, int | float]:
    """``loader`` prepared under the Trainer's settings, and its number of batches under the limit.
    A CombinedLoader's loaders are prepared each (sharded, seeded), and the limit applies to each, as in
    Lightning: its number of batches then follows its mode (``trainer/combined_loader.py``)."""
    seed = None if trainer.seed is None else trainer.seed + seed_offset
    settings = dict(shuffle=shuffle, strategy=trainer.strategy, seed=seed, limit=trainer.limits[stage],
                    sequential=bool(trainer.overfit_batches), shard=trainer.use_distributed_sampler)
    if not isinstance(loader, CombinedLoader):
        return prepare_loader(loader, stage, **settings)
    prepared = [prepare_loader(each, stage, **settings) for each in loader.flattened]
    loader = copy.copy(loader)  # the user's keeps their loaders (a second fit prepares them anew)
    loader.flattened = [each for each, _ in prepared]
    loader.limits = [count for _, count in prepared]
    return loader, loader.length()


@dataclasses.dataclass(frozen=True)
class FitLoaders:
    """fit's loaders as the loop runs them (sharded, seeded, limited), and what the Trainer takes
    from them: its ``max_epochs`` (a default when neither limit is given), the counts of batches."""

    train: Any  # iterated through ``sampler``, a ResumableBatchSampler
    shown: Any  # trainer.train_dataloader: the loader prepared (a CombinedLoader's collection), as in Lightning
    sampler: ResumableBatchSampler  # records each epoch's RNG for resuming
    val: list[Any] | None  # None: no validation
    max_epochs: int | None
    num_training_batches: int | float
    num_val_batches: list[int | float]  # as the Trainer reports them (shown_counts)
    val_limits: list[int | float]  # the batches the loop runs of each loader in ``val``
    made: list[Any]  # the loaders made this time: their persistent workers end with the stage (end_workers)
    val_loaded_at: float = 0  # the epoch the val loaders count as made at, as Lightning counts (val_reload_due)
    val_pending: bool = False  # validation is defined but its loaders not made yet: as Lightning's, when it first runs

    @property
    def validates(self) -> bool:
        """Whether fit validates: loaders with batches, or loaders still to be made."""
        return self.val is not None or self.val_pending


def load_fit_data(trainer: Trainer, data: DataSource, previous: FitLoaders | None = None,
                  kinds: tuple[str, ...] = ("train", "val")) -> FitLoaders:
    """The training loader and the validation loaders, prepared under the Trainer's settings; only
    those of ``kinds`` are made anew, the others are ``previous``'s (reload_dataloaders_every_n_epochs)."""
    every = trainer.reload_dataloaders_every_n_epochs  # a reloaded loader gets a seed of its own, not epoch 0's
    offset = trainer.current_epoch - trainer.current_epoch % every if every else 0
    if "train" in kinds:
        train = _load_train(trainer, data, offset)
    elif previous is None:  # the sanity check's val loaders come first, as Lightning's: the training loader next
        train = dict(train=None, shown=None, sampler=None, max_epochs=trainer.max_epochs, num_training_batches=math.inf, made=[])
    else:  # the training loader in use, and no loader made
        train = {name: getattr(previous, name) for name in _TRAIN_FIELDS} | {"made": []}
    if "val" not in kinds and previous is None:  # as Lightning's: the val loaders are made when validation first runs
        return FitLoaders(**train, val=None, num_val_batches=[], val_limits=[], val_loaded_at=-math.inf,
                          val_pending=data.defines("val"))
    if "val" not in kinds:
        return FitLoaders(**train, val=previous.val, num_val_batches=previous.num_val_batches,
                          val_limits=previous.val_limits, val_loaded_at=previous.val_loaded_at,
                          val_pending=previous.val_pending)
    val = [prepare_stage_loader(trainer, loader, "validate", False, offset) for loader in data.loaders("val")]
    trainer.metrics.restart_evaluation_steps("validate")  # new loaders: their step rows count from 0 (Lightning's)
    val_counts = [count for _, count in val]
    val_loaders = [loader for loader, _ in val]
    return FitLoaders(**(train | {"made": train["made"] + val_loaders}),
                      val=val_loaders if any(val_counts) else None,  # limit_val_batches=0: no validation, hooks included
                      num_val_batches=shown_counts(val_loaders, val_counts), val_limits=val_counts,
                      val_loaded_at=_val_loaded_at(trainer))


_TRAIN_FIELDS = ("train", "shown", "sampler", "max_epochs", "num_training_batches")


def _load_train(trainer: Trainer, data: DataSource, offset: int) -> dict[str, Any]:
    """The training loader prepared: :class:`FitLoaders`' fields of it (:data:`_TRAIN_FIELDS`, and ``made``).
    With ``limit_train_batches=0`` none is asked for (``num_training_batches`` stays ``inf``), as Lightning's
    fit loop, which then skips itself, never asks."""
    if trainer.limits["train"] == 0:
        max_epochs = default_max_epochs(trainer.max_epochs, trainer.max_steps, (), warn=False)
        return dict(train=None, shown=None, sampler=None, max_epochs=max_epochs, num_training_batches=math.inf,
                    made=[])
    [train_loader] = data.loaders("train")
    max_epochs = default_max_epochs(trainer.max_epochs, trainer.max_steps, train_loader, warn=trainer.is_global_zero)
    prepared, num_batches = prepare_stage_loader(trainer, train_loader, "train", True, offset)
    if isinstance(prepared, CombinedLoader) and prepared.mode == "sequential":
        trainer.num_training_batches = num_batches  # as Lightning's fit loop, which counts them before it refuses
        data.refuse_sequential_training()
    train_loader, sampler = resumable(prepared)  # records each epoch's RNG for resuming
    if trainer.is_global_zero and trainer.loggers and num_batches < trainer.log_every_n_steps and not trainer.fast_dev_run:
        warn(f"The number of training batches ({num_batches}) is smaller than the logging interval "
             f"Trainer(log_every_n_steps={trainer.log_every_n_steps}): the first epoch logs no training step. Set a "
             "lower value for log_every_n_steps if you want to see logs for the training epoch.", PossibleUserWarning)
    shown = prepared.iterables if isinstance(prepared, CombinedLoader) else prepared
    return dict(train=train_loader, shown=shown, sampler=sampler, max_epochs=max_epochs, num_training_batches=num_batches,
                made=[prepared, train_loader])


def _val_loaded_at(trainer: Trainer) -> float:
    """The epoch val loaders made now count as made at. Lightning makes them when validation first runs:
    the first epoch from now that validates (``check_val_every_n_epoch``), or now for the sanity check,
    which then counts only when this epoch validates too (else its next validation makes them again)."""
    epoch, every = trainer.current_epoch, trainer.check_val_every_n_epoch
    first = epoch if every is None else epoch + (-(epoch + 1)) % every
    sanity_check = trainer.num_sanity_val_steps != 0 and trainer.ckpt_path is None and trainer.stage == "fit"
    return -math.inf if sanity_check and first != epoch else first


def resumed_fit_loaders(loaders: FitLoaders, trainer: Trainer) -> FitLoaders:
    """``loaders``, made before a checkpoint was restored, counted as Lightning counts them: the val
    loaders as made when the resumed fit first validates (Lightning makes them then)."""
    return dataclasses.replace(loaders, val_loaded_at=_val_loaded_at(trainer))


def validates_in(epoch: int, check_val_every_n_epoch: int | None) -> bool:
    """Whether fit validates in ``epoch`` (``check_val_every_n_epoch``; None: by batches, every epoch may)."""
    return check_val_every_n_epoch is None or (epoch + 1) % check_val_every_n_epoch == 0


def val_reload_due(every: int, epoch: int, loaders: FitLoaders, data: DataSource) -> bool:
    """Whether to make the val loaders now, when validation (or the sanity check) is about to run: the first
    time (as Lightning's, not before), and with reload_dataloaders_every_n_epochs (``every``) when ``every``
    epochs have passed since they were made."""
    return loaders.val_pending or (bool(every) and data.from_hook("val") and epoch - loaders.val_loaded_at >= every)


def estimated_stepping_batches(num_batches: int | float, accumulate_grad_batches: int, max_epochs: int | None,
                               max_steps: int) -> int | float:
    """Lightning's ``trainer.estimated_stepping_batches``: the optimizer steps ``fit`` will take, for
    schedulers that need the total (``OneCycleLR(total_steps=...)``) in ``configure_optimizers``.

    The batches per epoch (``num_batches``: after ``limit_train_batches`` and, under DDP, per rank)
    over ``accumulate_grad_batches``, times ``max_epochs``, capped by ``max_steps``; ``inf`` when
    neither bounds the run.
    """
    epochs = max_epochs if max_epochs not in (None, -1) else math.inf
    if math.isinf(num_batches):  # a loader without a length (an IterableDataset): only max_steps bounds it
        total = math.inf
    else:
        total = math.ceil(num_batches / accumulate_grad_batches) * max(epochs, 1) if num_batches else 0
    return min(total, max_steps) if max_steps != -1 else total


def limit_reached(max_epochs: int | None, max_steps: int, epoch: int, step: int, limit_train_batches: int | float = 1.0
                  ) -> str | None:
    """Which of ``limit_train_batches=0``, ``max_steps`` and ``max_epochs`` ends fit at ``epoch`` and
    global ``step``, and how to train more; None: none."""
    if limit_train_batches == 0:  # as in Lightning, fit then trains nothing (it may still sanity-check validation)
        return f"limit_train_batches={limit_train_batches} leaves no batch to train on. Raise limit_train_batches"
    if max_steps != -1 and step >= max_steps:
        return f"max_steps={max_steps} reached (global_step={step}). Raise max_steps"
    if max_epochs not in (None, -1) and epoch >= max_epochs:
        return f"max_epochs={max_epochs} reached (current_epoch={epoch}). Raise max_epochs"
    return None


def say_min_not_met(min_epochs: int | None, min_steps: int | None, say: bool) -> bool:
    """should_stop was set before ``min_epochs``/``min_steps`` were met: say so (``say``: rank zero), in
    Lightning's words, through logging at INFO as Lightning's when the program configured it (else on stderr);
    returns True (said)."""
    if say:
        info(f"Trainer was signaled to stop but the required `min_epochs={min_epochs!r}` or `min_steps={min_steps!r}` "
             "has not been met. Training will continue until they are.")
    return True


def say_fit_stopped(max_epochs: int | None, max_steps: int, epoch: int, step: int, say: bool) -> None:
    """Lightning's line (``say``: rank zero) when fit ends at ``max_steps`` or ``max_epochs``, through
    logging at INFO when the program configured it (else on stderr); nothing when something else stopped it."""
    if say and max_steps != -1 and step >= max_steps:
        info(f"`Trainer.fit` stopped: `max_steps={max_steps!r}` reached.")
    elif say and max_epochs not in (None, -1) and epoch >= max_epochs:
        info(f"`Trainer.fit` stopped: `max_epochs={max_epochs!r}` reached.")


def say_trained_nothing(limit: str | None, say: bool = True) -> None:
    """fit found nothing to train (a second fit to the same limit, a resume from the end,
    ``limit_train_batches=0``): why (``limit``, from :func:`limit_reached`; None: should_stop was set
    already) and how to train more (``say``: rank zero)."""
    why = limit or "trainer.should_stop was already set. Set trainer.should_stop = False"
    if say:
        print(f"Trainer.fit trained nothing: {why} to train more.", file=sys.stderr, flush=True)


def reload_due(every: int, epoch: int, loaded_at: int, data: DataSource) -> bool:
    """reload_dataloaders_every_n_epochs (``every``): as Lightning's, the train hook makes a new loader
    when ``every`` epochs have passed since the one in use was made (``loaded_at``; a resumed fit's counts
    as made at the epoch it resumes at); the val loaders: :func:`val_reload_due`."""
    return bool(every) and epoch - loaded_at >= every and data.from_hook("train")


@dataclasses.dataclass(frozen=True)
class ValidationSchedule:
    """When validation runs in one epoch, as Lightning's ``val_check_batch``: after every ``every``-th
    training batch of the epoch (of the whole run with ``counts_run``: an int ``val_check_interval`` and
    ``check_val_every_n_epoch=None``); ``every`` is inf for a loader without a length and
    ``val_check_interval=1.0``: once, after the epoch's last batch (:attr:`at_epoch_end`)."""

    every: int | float
    counts_run: bool = False

    @property
    def at_epoch_end(self) -> bool:
        return self.every == math.inf

    def due(self, batch_idx: int, batches_seen: int) -> bool:
        """After training batch ``batch_idx`` (``batches_seen`` since the first fit); per batch, no tensor read."""
        return self.every != math.inf and (batches_seen if self.counts_run else batch_idx + 1) % self.every == 0


def validation_schedule(val_check_interval: int | float, check_val_every_n_epoch: int | None, epoch: int,
                        num_batches: int | float) -> ValidationSchedule | None:
    """When validation runs in ``epoch`` (of ``num_batches`` training batches); None: not in this epoch.
    A float interval validates every ``int(num_batches * val_check_interval)`` batches, and at the epoch's
    end only where that divides the epoch (as in Lightning: 1/3 of 64 batches is 21, 42 and 63)."""
    if not validates_in(epoch, check_val_every_n_epoch):
        return None
    if isinstance(val_check_interval, int):
        if check_val_every_n_epoch is not None and val_check_interval > num_batches:
            raise MisconfigurationException(
                f"Trainer(val_check_interval={val_check_interval}) must be less than or equal to the number of the "
                f"training batches ({num_batches} in an epoch), or validation would never run. Use a smaller int, "
                "check_val_every_n_epoch=None to count batches across epochs, or limit_val_batches=0 for no validation."
            )
        return ValidationSchedule(val_check_interval, counts_run=check_val_every_n_epoch is None)
    if num_batches == math.inf:
        if val_check_interval == 1.0:
            return ValidationSchedule(math.inf)
        raise MisconfigurationException(
            f"Trainer(val_check_interval={val_check_interval}) is a fraction of the epoch, but the training loader "
            "has no length. Use 1.0 (the end of each epoch), an int (every N training batches), or "
            "limit_train_batches=N to give the epoch a length."
        )
    return ValidationSchedule(max(1, int(num_batches * val_check_interval)))


def shown_counts(loaders: list[Any], counts: list[int | float]) -> list[int | float]:
    """The numbers of batches the Trainer reports (``num_val_batches``...) for ``loaders`` that run
    ``counts`` batches: as Lightning's, a CombinedLoader in another mode than ``"sequential"`` counts
    each of its loaders under the limit (``[3, 2]``), though its step gets the combined batches."""
    shown: list[int | float] = []
    for loader, count in zip(loaders, counts):
        combined = isinstance(loader, CombinedLoader) and loader.mode != "sequential" and loader.limits is not None
        shown += list(loader.limits) if combined else [count]
    return shown


def evaluation_loaders(trainer: Trainer, stage: str, loaders: list[Any]) -> tuple[list[Any], list[int | float]]:
    """Validate, test or predict's loaders, prepared, and their numbers of batches (the Trainer's
    ``num_val_batches``, ``num_test_batches`` or ``num_predict_batches``: :data:`NUM_BATCHES`)."""
    if not loaders:
        raise MisconfigurationException(f"Trainer.{stage} got an empty list of loaders; pass at least one DataLoader.")
    prepared = [prepare_stage_loader(trainer, loader, stage, False) for loader in loaders]
    trainer.metrics.restart_evaluation_steps(stage)  # each call's step rows count from 0, as Lightning's loops
    made = [recording_batch_indices(loader) if stage == "predict" else loader for loader, _ in prepared]  # Lightning's
    return made, [count for _, count in prepared]


def train_batches(loader: Any, epoch: int, limit: int | float, progress: Progress,
                  transfer: BatchTransfer | None = None, fetch: Any = None) -> Iterator[tuple[int, Any]]:
    """``enumerate(loader)`` over epoch ``epoch`` under ``limit`` (its number of batches), resuming
    mid-epoch at the index level when ``progress.resumed`` (a restored checkpoint) is in this epoch;
    through the batch ``transfer`` hooks when any is defined (trainer/batch_transfer.py)."""
    for each in loader.flattened if isinstance(loader, CombinedLoader) else (loader,):
        set_sampler_epoch(each, epoch)
    progress.epoch_batches = limit
    resumed = progress.resumed
    if loader is not progress.iterated and epoch > 0 and (resumed is None or resumed.epoch != epoch):
        _lightnings_first_iterator(loader)  # a loader made since the fit loop set up its data (a search in a hook)
    progress.iterated, premade, progress.premade = loader, progress.premade, None
    skip = resumed.batches_done if resumed is not None and resumed.epoch == epoch else 0
    rest = None
    if skip:  # a checkpoint of another number of processes: the samples trained carry over (trainer/resume.py)
        skip, rest = resharded(progress.sampler, skip, resumed.processes, loader_length(loader))
    if skip >= limit or rest == []:  # the checkpoint was written after the epoch's last batch
        return iter(())
    # Resuming mid-epoch redraws the epoch's order from the RNG state it began with and skips
    # the batches already trained as indices; nothing is fetched twice (trainer/resume.py).
    # Workers start here with the stop signals held until they can ignore them (trainer/preemption.py).
    iterator = (premade[1] if premade is not None and premade[0] is loader and not (skip or rest) else
                _start(loader, (lambda loader: resume_iterator(loader, progress.sampler, skip, resumed.rng, rest))
                       if skip or rest else iter))
    batches = enumerate(iterator if fetch is None else fetch(iterator), start=skip)  # hot loop: C iterators only
    if limit < (loader_length(loader) or math.inf) or (isinstance(loader, CombinedLoader) and limit != math.inf):
        # islice stops after the last batch without fetching another. Otherwise the loader runs
        # out on its own, as in `for batch in loader`: a shuffling RandomSampler draws from its
        # generator when it runs out, so stopping one next() early changes every later epoch's order.
        # A CombinedLoader stops where its length (under its limits) says, as in Lightning.
        return transferred(itertools.islice(batches, limit - skip), transfer)
    return transferred(batches if limit != math.inf else _one_ahead(batches, progress), transfer)


def lightnings_setup_iterator(loader: Any, epoch: int, progress: Progress, early: bool = False) -> None:
    """The training iterator Lightning's fit loop makes when it sets up its data: before ``on_train_start`` (after
    the sanity check, before the val loaders it makes for the progress bar) and, at a
    ``reload_dataloaders_every_n_epochs`` epoch, before ``on_train_epoch_start``. Its draws (a base seed; with
    workers, the sampler's order for their prefetched batches) come before what those hooks draw, as in Lightning.
    Epoch 0 trains on it; a later epoch makes its own after ``on_train_epoch_start`` and this one is thrown away
    (:func:`_lightnings_first_iterator`). An epoch that resumes a checkpoint makes only its own (trainer/resume.py).
    ``early``: ``trainer.estimated_stepping_batches`` (read in ``configure_optimizers``) made the loader, and Lightning
    sets up its data there; the call after the sanity check keeps that iterator, unless the fit resumes a checkpoint
    (whose RNG states replace what it drew)."""
    made_early, progress.made_early = progress.made_early, None
    if not early and loader is not None and made_early is loader and progress.resumed is None:
        return
    resumed, progress.premade = None if early else progress.resumed, None  # none left from a fit stopped early
    if loader is None or (resumed is not None and resumed.epoch == epoch):
        return
    progress.iterated, progress.made_early = loader, loader if early else None  # train_batches makes no other first one
    if epoch > 0:
        _lightnings_first_iterator(loader)
    else:
        progress.premade = (loader, _start(loader))


def first_evaluation_batches(loaders: list[Any], limits: list[int | float], transfer: BatchTransfer | None,
                             epoch: int | None, fetch: Any = None) -> tuple[Any, Iterator[tuple[int, Any]]] | None:
    """The first loader's batches, made before the ``on_{stage}_start`` hooks: Lightning's evaluation loop makes
    that iterator (its base seed drawn; with workers, started) when it resets, before them, so that what they
    draw comes after it, as in Lightning. ``(loader, batches)`` for :func:`evaluation_batches`' caller."""
    return (loaders[0], evaluation_batches(loaders[0], limits[0], transfer, 0, epoch, fetch)) if loaders else None


def _lightnings_first_iterator(loader: Any) -> None:
    """Make the iterator Lightning makes and throws away. Its fit loop makes the iterator of a training loader it
    has just made (in a fit that starts past epoch 0, or at a reload_dataloaders_every_n_epochs epoch) twice before
    the first batch, unless the epoch resumes a checkpoint. What that costs is Lightning's too: the first iterator
    draws a base seed and, with workers, starts them and draws the sampler's order for its prefetched batches (a
    loader with persistent workers keeps that iterator, and the second iter() draws the order again). Made here,
    every later draw (this epoch's order, dropout, the next epochs) is Lightning's."""
    for each in loader.flattened if isinstance(loader, CombinedLoader) else (loader,):
        if isinstance(each, DataLoader):
            iterate_shielded(each, iter)  # its workers with the stop signals held, as the loop starts them


def _one_ahead(batches: Iterator[tuple[int, Any]], progress: Progress) -> Iterator[tuple[int, Any]]:
    """A loader without a length read one batch ahead, as Lightning's fetcher reads it: the last batch
    is known before it trains (``progress.epoch_batches`` set then), so the optimizer steps there under
    accumulation and the epoch's schedulers step before its hooks; and what making a batch does (an
    agent playing an episode in an IterableDataset) happens while the batch before it trains."""
    pending = next(batches, None)
    for ahead in batches:
        yield pending
        pending = ahead
    if pending is not None:
        progress.epoch_batches = pending[0] + 1
        yield pending


def evaluation_batches(loader: Any, limit: int | float, transfer: BatchTransfer | None = None,
                       dataloader_idx: int = 0, epoch: int | None = None, fetch: Any = None) -> Iterator[tuple[int, Any]]:
    """``enumerate(loader)``, its first ``limit`` batches (``math.inf``: all), its workers started
    with the stop signals held until they can ignore them (trainer/preemption.py); through the batch
    ``transfer`` hooks when any is defined. As Lightning, its sampler's ``set_epoch(epoch)`` first."""
    for each in (loader.flattened if isinstance(loader, CombinedLoader) else [loader]) if epoch is not None else ():
        set_sampler_epoch(each, epoch)
    batches = enumerate(_start(loader) if fetch is None else fetch(_start(loader)))
    return transferred(batches if limit == math.inf else itertools.islice(batches, int(limit)), transfer, dataloader_idx)


_NEVER = object()  # what no __next__ returns: iter(next, _NEVER) ends only at StopIteration


def _start(loader: Any, make_iterator: Any = iter) -> Iterator[Any]:
    """``make_iterator(loader)`` with its workers shielded; a CombinedLoader's batches without
    Lightning's ``batch_idx`` and ``dataloader_idx`` (the loop counts its own)."""
    if not isinstance(loader, CombinedLoader):
        return iterate_shielded(loader, make_iterator)
    with_workers = [each for each in loader.flattened if getattr(each, "num_workers", 0)]
    shielding = with_workers[0] if with_workers else loader  # their workers start at the same iter()
    started = iterate_shielded(shielding, lambda _: make_iterator(loader))
    # Its __next__, not the loader: iter(CombinedLoader) starts a new pass (as in Lightning), which would
    # undo the batches a resume skipped.
    return map(operator.itemgetter(0), iter(started.__next__, _NEVER))


def gather_predictions(predictions: list[list[Any]], strategy: Any) -> list[list[Any]]:
    """Each loader's predictions of every rank, end to end on the CPU. Each rank predicted one
    contiguous block of the dataset (the predict loader's sharding): together, the whole dataset in
    order, each sample once."""
    if strategy.world_size == 1:
        return predictions
    gathered = (strategy.all_gather_object(move_to_device(shard, torch.device("cpu"), non_blocking=False))
                for shard in predictions)
    return [[prediction for rank in ranks for prediction in rank] for ranks in gathered]


def end_workers(loaders: list[Any]) -> None:
    """End the worker processes that ``persistent_workers=True`` keeps alive, now, as Lightning does
    at the end of a stage. Left to the garbage collector (the Trainer and the module refer to each
    other, so only a collection frees them), the loader, its iterator and its queues are collected
    in no set order, and the shutdown then waits 5 s for each worker that never got its stop."""
    for loader in (each for loader in loaders for each in
                   (loader.flattened if isinstance(loader, CombinedLoader) else (loader,))):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None

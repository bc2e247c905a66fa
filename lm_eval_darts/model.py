"""``hf-darts``: lm-eval's HF backend with a merged checkpoint's DARTS surgery on the final hidden state.

Thin on purpose, like ``lm_eval/models/hf_steered.py``: :class:`mergekit_darts.apply.SurgeryHandle`
owns the correction and every token's position (right-padded loglikelihood batches, left-padded
generation, KV cache, ``logits_to_keep``). This class only chooses which task's module is active.

With ``surgery=auto`` the module depends on each request's lm-eval task. HFLM merges identical
requests across tasks and scores a whole call in shared batches, so one module per row cannot work;
each call is split by module and HFLM runs once per group with that module active.

Under ``--use_cache`` lm-eval keys each cached answer by its request alone; the cache database is
given a key of the correction in use (:meth:`SurgeryPlan.cache_key`) to fold into every key, so
runs with different corrections never read each other's answers, while ``surgery=none`` shares
``hf``'s (they are the same answers).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from lm_eval.api.instance import Instance
from lm_eval.api.model import CacheHook
from lm_eval.models.huggingface import HFLM

from lm_eval_darts.hook import register
from lm_eval_darts.leakage import LeakageCheck
from mergekit_darts.apply import Correction, SurgeryHandle, model_folder
from mergekit_darts.errors import (
    ModelArgsError,
    SurgeryFormatError,
    UnsupportedModelError,
)
from mergekit_darts.folder.artifacts import (
    load_joint,
    load_routed,
    load_surgery,
    read_manifest,
    resolve_task,
)
from mergekit_darts.task_map import (
    AUTO,
    JOINT,
    NONE,
    OTHER_WEIGHTS,
    ROUTED,
    manifest_task_map,
    parse_surgery_map,
    surgery_task_for,
)

eval_logger = logging.getLogger(__name__)

_NOT_GIVEN: Any = object()  # the CLI turns `surgery=none` into "none", simple_evaluate into None
_CLOSE = 0.8  # difflib ratio above which an argument name reads as a misspelling of one of ours
R = TypeVar("R")


def default_surgery_path(pretrained: Any, subfolder: str, revision: str | None) -> Path:
    """``<pretrained>[/<subfolder>]/surgery``; for a hub id, only that folder is downloaded."""
    base = pretrained if isinstance(pretrained, str) else getattr(pretrained, "name_or_path", "")
    if not base:
        raise ModelArgsError("pretrained is a model object without a folder: pass surgery_path=")
    local = Path(base, subfolder, "surgery")
    if Path(base).exists():
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        root = snapshot_download(
            base, revision=revision, allow_patterns=[str(PurePosixPath(subfolder, "surgery", "*"))]
        )
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise SurgeryFormatError(
            f"no local folder {base!r} and its surgery/ folder could not be fetched from the hub "
            f"({type(err).__name__}): pass surgery_path="
        ) from err
    return Path(root, subfolder, "surgery")


def weights_folder(pretrained: Any, subfolder: str) -> Path | None:
    """The local folder of the weights hf-darts corrects (None for a Hub id: the folder around
    the downloaded surgery/ stands in for it)."""
    if not isinstance(pretrained, str):
        return model_folder(pretrained)
    folder = Path(pretrained, subfolder)
    return folder if folder.is_dir() else None


@dataclass(frozen=True)
class SurgeryPlan:
    """What ``hf-darts`` applies: one task's module, every module behind the folder's router, the
    joint correction, a module per lm-eval task (the task map), or nothing."""

    mode: str  # a surgery task name, ROUTED, JOINT, AUTO or NONE
    folder: Path | None = None
    available: tuple[str, ...] = ()
    served: Mapping[str, str] | None = None  # lm-eval task or glob -> surgery task | NONE (auto)
    modules: Mapping[str, Correction] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        surgery: Any,
        surgery_map: str | Mapping[str, Any] | None,
        surgery_path: str | None,
        pretrained: Any,
        subfolder: str,
        revision: str | None,
    ) -> SurgeryPlan:
        """Check the model args against the surgery folder and load the modules they need."""
        keyword = None if surgery is _NOT_GIVEN else str(surgery).lower()
        if surgery is None or keyword == NONE:
            if surgery_map is not None:
                raise ModelArgsError("surgery_map applies to surgery=auto, not to surgery=none")
            return cls(NONE)
        if surgery_map is not None and keyword not in (None, AUTO):
            raise ModelArgsError(f"surgery_map applies to surgery=auto, not to surgery={surgery}")
        folder = Path(surgery_path or default_surgery_path(pretrained, subfolder, revision))
        manifest = read_manifest(folder)
        weights = weights_folder(pretrained, subfolder)
        names = tuple(manifest.tasks)
        if keyword is None and surgery_map is None:
            if len(names) > 1:
                raise ModelArgsError(
                    f"{folder} holds surgery tasks {', '.join(names)}: choose "
                    f"surgery=<task>, surgery=auto (per lm-eval task), "
                    f"surgery=routed (by the router, if the block had route:), surgery=joint "
                    f"(one plain correction for every task, if one was fitted) or surgery=none"
                )
            surgery = names[0]
        if keyword == ROUTED:
            routed = load_routed(folder, weights=weights)
            return cls(ROUTED, folder, names, modules={ROUTED: routed})
        if keyword == JOINT:
            joint = load_joint(folder, weights=weights)
            return cls(JOINT, folder, names, modules={JOINT: joint})
        if surgery_map is None and keyword != AUTO:
            task = resolve_task(manifest, str(surgery), folder)
            module = load_surgery(folder, task, weights=weights)
            return cls(task, folder, names, modules={task: module})
        served = (
            manifest_task_map(manifest) if surgery_map is None else parse_surgery_map(surgery_map)
        )
        targets = {target for target in served.values() if target != NONE}
        if unknown := targets - set(names):
            raise SurgeryFormatError(
                f"surgery_map names surgery task(s) {', '.join(sorted(unknown))} not in {folder}; "
                f"available: {', '.join(names)} (or none)"
            )
        modules = {task: load_surgery(folder, task, weights=weights) for task in sorted(targets)}
        return cls(AUTO, folder, names, served, modules)

    def cache_key(self) -> str | None:
        """What the answers depend on besides the request: the mode, the task map and every
        module by content (None for no correction: ``hf``'s answers)."""
        if self.mode == NONE:
            return None
        digest = hashlib.sha256(json.dumps([self.mode, dict(self.served or {})]).encode())
        for name, module in sorted(self.modules.items()):
            digest.update(f"{name}\0{module!r}\0".encode())
            for key, tensor in sorted(module.state_dict().items()):
                digest.update(key.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()


@functools.cache
def _keyed(database: type) -> type:
    """``database`` (lm-eval's cache, a ``SqliteDict``) with every key qualified by
    ``darts_key()``, the correction in use (None: the key as it is).

    lm-eval's ``CachingLM`` computes the keys itself and gives the model only the database, so the
    correction is folded in where keys are looked up and stored.
    """

    class Keyed(database):  # type: ignore[valid-type, misc]
        darts_key: Callable[[], str | None]

        def _qualified(self, key: str) -> str:
            extra = self.darts_key()
            return key if extra is None else hashlib.sha256(f"{extra}\0{key}".encode()).hexdigest()

        def __contains__(self, key: object) -> bool:
            return super().__contains__(self._qualified(str(key)))

        def __getitem__(self, key: str) -> Any:
            return super().__getitem__(self._qualified(key))

        def __setitem__(self, key: str, value: Any) -> None:
            super().__setitem__(self._qualified(key), value)

    return Keyed


class DartsHFLM(HFLM):
    """HFLM whose LM head sees ``module(h, p)`` instead of ``h`` (DARTS, paper eq. 4).

    Model args: ``surgery=<task>|auto|routed|none`` (default: the folder's only task; ``routed``:
    every request gets the router-weighted correction, whatever its lm-eval task),
    ``surgery_path=`` (default ``<pretrained>/surgery``) and ``surgery_map=<lm-eval task>:<surgery
    task>;...`` (replaces the manifest's ``eval_tasks`` map; implies ``auto``). Everything else
    goes to HFLM unchanged, except ``peft=`` and ``delta=``, refused with a surgery: they change
    the weights it was calibrated on. A look-alike of the three names (``surgerypath=``) is
    refused before any load. ``surgery=none`` attaches nothing, so it scores exactly like ``hf``.
    """

    def __init__(
        self,
        pretrained: Any,
        surgery: Any = _NOT_GIVEN,
        surgery_path: str | None = None,
        surgery_map: str | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Checked before HFLM loads the model, so a typo costs no model load.
        refuse_misspelled_args(kwargs)
        self._source = (pretrained, kwargs.get("subfolder") or "", kwargs.get("revision", "main"))
        self._other_weights = {name: kwargs[name] for name in OTHER_WEIGHTS if kwargs.get(name)}
        plan = self._checked(SurgeryPlan.resolve(surgery, surgery_map, surgery_path, *self._source))
        super().__init__(pretrained=pretrained, **kwargs)
        self._handle: SurgeryHandle | None = None
        self._use(plan)

    def set_surgery(
        self,
        surgery: Any = AUTO,
        surgery_path: str | None = None,
        surgery_map: str | Mapping[str, Any] | None = None,
    ) -> None:
        """Switch to other modules (or none) on the loaded model, with the constructor's rules.

        A sweep scores many surgery folders on one merged model: swapping the modules between
        them costs nothing, reloading the model for each would cost a full load.
        """
        plan = SurgeryPlan.resolve(surgery, surgery_map, surgery_path, *self._source)
        self._use(self._checked(plan))

    def _checked(self, plan: SurgeryPlan) -> SurgeryPlan:
        """``plan``, unless it would correct weights that ``peft=`` or ``delta=`` changed."""
        if plan.mode != NONE and self._other_weights:
            name, value = next(iter(self._other_weights.items()))
            raise ModelArgsError(
                f"hf-darts: {name}={value} changes the merged weights, but the surgery in "
                f"{plan.folder} was calibrated on them without {name}= and corrects only those; "
                f"drop {name}=, or pass surgery=none to evaluate without a correction"
            )
        return plan

    def _use(self, plan: SurgeryPlan) -> None:
        self.surgery = plan
        self._cache_key = plan.cache_key()
        # counts belong to one set of modules: a sweep cell must not report the previous cell's
        self._leakage = LeakageCheck(self.tokenizer)
        if plan.mode == NONE:
            if self._handle is not None:
                self._handle.module = None  # the hooks stay, inert: exactly hf's numbers
            return
        if self.backend != "causal":
            raise UnsupportedModelError(
                f"hf-darts corrects decoder-only models; this one is {self.backend}"
            )
        fixed = plan.modules.get(plan.mode)  # None under auto until a call
        if self._handle is None:
            self._handle = SurgeryHandle(self.model, fixed)
        else:
            self._handle.module = fixed
        eval_logger.info("hf-darts: surgery=%s from %s", plan.mode, plan.folder)

    def _grouped(
        self,
        run: Callable[..., list[R]],
        requests: list[Instance],
        disable_tqdm: bool,
    ) -> list[R]:
        """Run HFLM's ``run`` once per surgery module, each group with its module active."""
        if self._handle is not None:
            self._leakage.check(requests, self.surgery.folder, self._serving)
        served = self.surgery.served
        if served is None or self._handle is None:
            return run(requests, disable_tqdm=disable_tqdm)
        module_of = {
            name: surgery_task_for(served, name) if name else None
            for name in {r.task_name for r in requests}
        }
        if unmapped := sorted(str(name) for name, target in module_of.items() if target is None):
            raise ModelArgsError(
                f"surgery=auto has no module for lm-eval task(s) {', '.join(unmapped)}; mapped: "
                f"{', '.join(f'{k}:{v}' for k, v in served.items())}; available surgery tasks: "
                f"{', '.join(self.surgery.available)} (extend surgery_map=, map a task to none, "
                f"or use surgery=<task>)"
            )
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(module_of[req.task_name], []).append(i)
        results: list[Any] = [None] * len(requests)
        try:
            # sorted, so every data-parallel rank makes the same sequence of HFLM calls
            for target in sorted(groups):
                self._handle.module = self.surgery.modules.get(target)  # None for NONE
                indices = groups[target]
                answers = run([requests[i] for i in indices], disable_tqdm=disable_tqdm)
                for i, answer in zip(indices, answers, strict=True):
                    results[i] = answer
        finally:
            self._handle.module = None
        return results

    def _serving(self, task_name: str) -> str | None:
        """The surgery module that serves an lm-eval task (None: none or unmapped)."""
        if self.surgery.served is None:
            return self.surgery.mode
        try:
            target = surgery_task_for(self.surgery.served, task_name)
        except ValueError:  # ambiguous patterns: _grouped reports it
            return None
        return None if target == NONE else target

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        return self._grouped(super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        return self._grouped(super().loglikelihood_rolling, requests, disable_tqdm)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._grouped(super().generate_until, requests, disable_tqdm)

    def set_cache_hook(self, cache_hook: CacheHook) -> None:
        database = cache_hook.dbdict
        if database is not None:  # --use_cache: fold the correction into the database's keys
            if not hasattr(database, "darts_key"):
                database.__class__ = _keyed(type(database))
            database.darts_key = lambda: self._cache_key
        # the keys still hold no lm-eval task, so under `auto` a request shared by two tasks
        # would come back from the cache with the other task's correction
        if self.surgery.mode == AUTO and database is not None:
            eval_logger.warning(
                "hf-darts: --use_cache keys requests by text only; with surgery=auto, identical "
                "requests of tasks served by different modules share one cached answer"
            )
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["darts_surgery"] = self.surgery.mode
        if self.surgery.folder is not None:
            info["darts_surgery_path"] = str(self.surgery.folder)
        if self.surgery.served is not None:
            info["darts_surgery_map"] = dict(self.surgery.served)
        if self._handle is not None:  # requests per lm-eval task that reuse calibration prompts
            info["darts_calibration_overlap"] = dict(self._leakage.counts)
        return info


def refuse_misspelled_args(kwargs: Mapping[str, Any]) -> None:
    """Refuse an argument that looks like one of hf-darts' own but is not.

    HFLM hands unknown arguments to ``from_pretrained``, so ``surgerypath=`` would fail only after
    the weights load, as a ``TypeError`` from the model class. Only look-alikes (containing
    "surg", or close to one of ours) are refused: any other argument is HFLM's to judge.
    """
    ours = [name for name in inspect.signature(DartsHFLM.__init__).parameters if "surg" in name]
    for name in kwargs:
        close = difflib.get_close_matches(name.lower(), ours, n=1, cutoff=_CLOSE)
        if "surg" not in name.lower() and not close:
            continue
        meant = close or difflib.get_close_matches(name.lower(), ours, n=1, cutoff=0)
        raise ModelArgsError(
            f"hf-darts: unknown model argument {name}=; did you mean {meant[0]}=? (hf-darts reads "
            f"{', '.join(f'{n}=' for n in ours[:-1])} and {ours[-1]}=; other arguments go to "
            "lm-eval's hf model)"
        )


register()

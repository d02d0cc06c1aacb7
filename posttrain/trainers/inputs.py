"""The files and folders a run names, and the data keys it reads, checked together at start-up, before
anything is printed or written (the trainers' configs, and `posttrain generate` / `eval`'s, which read
--data.dataset with --data.split): `check_inputs(cfg)` raises one ConfigError naming every model path (model,
reference, critic, reward model), dataset (training, prompts, eval) and reward / agent file that is missing
or broken, every rule between the flags and a model's config.json (`model_rule_problems`), and every key flag
whose key a training or eval data file lacks (`key_problems`, from the first row of each file); the loads
that follow (tokenizer, rows, sizes) raise their own errors, still before the echo.
`check_sampling_inputs(cfg)`: the same for chat, generate and eval. Nothing here imports torch or
transformers at module level (a config.json rule imports torch only where its flag is set), so the CLI runs
these checks before it imports a trainer."""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from posttrain.config import TrainerConfig, changed_values, flag_specs
from posttrain.config.roles import reward_func_spec
from posttrain.config.spec import get_path
from posttrain.config.validate import tensor_parallel_split
from posttrain.data.errors import DataError
from posttrain.data.images import max_images, max_images_flag
from posttrain.data.sources import missing_source, source_columns
from posttrain.data.validation import MARGIN_KEY, close_key
from posttrain.models.config_facts import check_tensor_parallel_folder, is_vision_folder, vocab_size_of
from posttrain.models.folders import check_model_folder
from posttrain.utils.errors import ConfigError, UserError

MODEL_FLAGS = ("model.model_name_or_path", "actor.model_name_or_path", "critic.model_name_or_path",
               "ref.model_name_or_path", "reward.model_name_or_path", "teacher.model_name_or_path")
DATA_FLAGS = ("data.dataset", "data.prompt_dataset", "eval.dataset")
SPLIT_FLAGS = {"data.dataset": "data.dataset_split", "data.prompt_dataset": "data.prompt_split",
               "eval.dataset": "eval.split"}  # `generate` / `eval` name --data.dataset's split --data.split
# local .py files (a URL is checked when called)
FILE_FLAGS = ("reward.remote_url", "reward.func_path", "train.agent_func_path", "train.tool_path")


def dataset_names(cfg: TrainerConfig, flag: str) -> list[str]:
    """The sources `flag` (one of DATA_FLAGS) names: comma-separated (or a list), [] when unset or absent."""
    value = get_path(cfg, flag) if flag in {spec.path for spec in flag_specs(type(cfg))} else None
    names = value.split(",") if isinstance(value, str) else value or ()
    return [name.strip() for name in names if name.strip()]


def input_problems(cfg: TrainerConfig) -> list[str]:
    """One line per missing or broken input of `cfg` (each names its flag), in flag order; then the data
    keys the data lacks (`key_problems`)."""
    paths = {spec.path for spec in flag_specs(type(cfg))}
    problems, models = [], set()
    for flag in MODEL_FLAGS:
        value = get_path(cfg, flag) if flag in paths else None
        if value:
            try:
                check_model_folder(value)
                models.add(value)
            except (UserError, FileNotFoundError) as e:
                problems.append(f"--{flag}: {e}")
    for flag in DATA_FLAGS:
        for name in dataset_names(cfg, flag):
            problem = missing_source(name)
            if problem:
                problems.append(f"--{flag}: {problem}")
    for flag in FILE_FLAGS:
        value = get_path(cfg, flag) if flag in paths else None
        for path in _local_files(flag, value):
            if not os.path.isfile(os.path.expanduser(path)):
                problems.append(f"--{flag}: no such file {os.path.abspath(os.path.expanduser(path))}")
    return problems + model_rule_problems(cfg, models) + key_problems(cfg)


def _local_files(flag: str, value) -> list[str]:
    """The local .py files a FILE_FLAGS value names: a .py path (not a URL); for --reward.func_path each
    entry's file (`FILE.py` or `FILE.py:FUNCTION`)."""
    if flag == "reward.func_path":
        files = []
        for entry in value or []:
            try:
                files.append(reward_func_spec(entry)[0])
            except ValueError:  # validation names it
                pass
        return files
    return [value] if isinstance(value, str) and value.endswith(".py") and "://" not in value else []


def model_rule_problems(cfg: TrainerConfig, models: set[str]) -> list[str]:
    """The rules between flags and a model's config.json, for the model paths in `models` (those that passed
    `check_model_folder`): the split models' attention heads and MLP divide by their tensor-parallel size
    (`models.config_facts.check_tensor_parallel_folder` on `config.validate.tensor_parallel_split`); an image
    limit (`data.images.max_images`) needs a vision-language model, which takes neither --ds.packing_samples
    nor, in ppo, --train.async_enable in this version; kd's teacher has the student's vocabulary
    (`vocab_problems`). These read config.json only (no torch)."""
    problems = []
    if not hasattr(cfg, "ds"):  # chat / generate / eval: no training flags to check against the model
        return problems
    ppo = cfg.trainer == "ppo"
    size, split = tensor_parallel_split(cfg)
    for path in dict.fromkeys(p for p in split if p in models):
        try:
            check_tensor_parallel_folder(path, size)
        except ConfigError as e:
            problems.append(str(e))
    model = cfg.actor.model_name_or_path if ppo else cfg.model.model_name_or_path
    teacher = getattr(getattr(cfg, "teacher", None), "model_name_or_path", None)
    if cfg.trainer == "kd" and teacher in models and model in models:  # ppo: build.check_teacher_vocabulary
        problems += vocab_problems(model, teacher)
    images, packing, async_rl = (max_images(cfg.data), cfg.ds.packing_samples,
                                 ppo and cfg.train.async_enable)
    if model in models and (images or packing or async_rl):
        vision = is_vision_folder(model)
        if images and not vision:
            problems.append(f"{max_images_flag(images)}: {model} is not a vision-language model "
                            "(its config has no vision part); drop the flag or train a vision-language model")
        if vision and packing:
            problems.append(f"--ds.packing_samples: {model} is a vision-language model, which trains on "
                            "padded batches (it computes its rotary positions per row from the image grid); "
                            "drop the flag")
        if vision and async_rl:
            problems.append(f"{model} is a vision-language model: --train.async_enable is not available "
                            "with one in this version")
    return list(dict.fromkeys(problems))


def vocab_problems(student: str, teacher: str) -> list[str]:
    """KD: the teacher's logits must cover the student's vocabulary token for token (read from both
    config.json files; [] where one cannot be read here)."""
    sizes = vocab_size_of(student), vocab_size_of(teacher)
    if None in sizes or sizes[0] == sizes[1]:
        return []
    return [f"--teacher.model_name_or_path: {teacher} has a vocabulary of {sizes[1]} tokens, the student "
            f"({student}) {sizes[0]}; distillation compares their next-token distributions token by token: "
            "use a teacher with the student's tokenizer"]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def teacher_tokenizer_problem(teacher: str, tokenizer, why: str) -> str | None:
    """One line (naming --teacher.model_name_or_path; `why` says why the two must agree) when the teacher
    folder has tokenizer files whose vocabulary is not `tokenizer`'s (the student's, loaded), else None (a
    hub id or a folder without tokenizer files: the embedding sizes are all that is checked)."""
    from posttrain.models import load_tokenizer

    files = [os.path.join(teacher, f) for f in TOKENIZER_FILES]
    if not (os.path.isdir(teacher) and any(os.path.isfile(f) for f in files)):
        return None
    if load_tokenizer(teacher).get_vocab() == tokenizer.get_vocab():
        return None
    return (f"--teacher.model_name_or_path {teacher}: the teacher's tokenizer has another vocabulary than "
            f"the student's; {why}")


class RowKey(NamedTuple):
    """A key the run reads from the rows of its training and eval data, and the flag that makes it read it;
    `every_row`: each row must have it (else only some rows do, e.g. those with images)."""

    flag: str
    key: str
    every_row: bool = True

    def missing(self, where: str, columns: list[str], files: int = 1) -> str:
        """The problem line: the key is not among `columns`, the keys of `where` (`files` files)."""
        key_flag = self.flag.endswith("_key")
        named = f"{self.flag} '{self.key}'" if key_flag else f"{self.flag} (key '{self.key}')"
        close = close_key(self.key, columns)
        fix = f"did you mean '{close}'?" if close else f"name one of them with {self.flag}, or fix the data" \
            if key_flag else f"add it to every row, or drop {self.flag}"
        whose = "their" if files > 1 else "its"
        return f"{named}: missing from {where} ({whose} keys: [{', '.join(columns)}]); {fix}"


def row_keys(cfg: TrainerConfig) -> list[RowKey]:
    """The keys `cfg`'s trainer reads from every row of its training and eval data (the same keys for both):
    the value of every `--data.*_key` flag that is set (SFT's input/output keys, whatever the template or
    --data.multiturn; the preference trainers' prompt/chosen/rejected keys; ppo's input/label keys), except
    `--data.image_key`, which is read only when the run reads images (`data.images.max_images` > 0) and
    is checked only when set (a row without images may lack it); and RM's margin with
    --model.margin_loss_enable."""
    keys = []
    for field in dataclasses.fields(cfg.data):
        value = getattr(cfg.data, field.name)
        if not field.name.endswith("_key") or value is None:
            continue
        if field.name == "image_key":
            if max_images(cfg.data) > 0 and "data.image_key" in changed_values(cfg):
                keys.append(RowKey("--data.image_key", value, every_row=False))
        else:
            keys.append(RowKey(f"--data.{field.name}", value))
    if cfg.trainer == "rm" and cfg.model.margin_loss_enable:
        keys.append(RowKey("--model.margin_loss_enable", MARGIN_KEY))
    return keys


def key_problems(cfg: TrainerConfig) -> list[str]:
    """One line per key of `row_keys` that a data file of the run lacks (from the first row of each file of
    each local dataset, split included; hub datasets are checked as their rows load): the flag, the file,
    the keys it has and the closest one. A key that not every row needs is a problem only when no file of
    the dataset flag has it. A split the dataset lacks or a first row that cannot be read is a problem of
    its dataset flag."""
    keys = row_keys(cfg)
    problems: list[str] = []
    for flag in DATA_FLAGS:
        files = []
        for name in dataset_names(cfg, flag):
            if missing_source(name):
                continue  # named by input_problems
            try:
                files += source_columns(name, _split(cfg, flag)) or []
            except DataError as e:
                problems.append(f"--{flag}: {e}")
        for key in keys:
            lacking = [(file, columns) for file, columns in files if key.key not in columns]
            if not key.every_row:  # only some rows need it: a problem when no file has it
                if files and len(lacking) == len(files):
                    where = files[0][0] if len(files) == 1 else f"each of the {len(files)} files of --{flag}"
                    every = list(dict.fromkeys(c for _, columns in files for c in columns))
                    problems.append(key.missing(where, every, len(files)))
                continue
            by_columns: dict[tuple, list[str]] = {}  # a folder of shards with the same keys: one line
            for file, columns in lacking:
                by_columns.setdefault(tuple(columns), []).append(file)
            for columns, names in by_columns.items():
                more = f" and {len(names) - 1} more files" if len(names) > 1 else ""
                problems.append(key.missing(names[0] + more, list(columns), len(names)))
    return list(dict.fromkeys(problems))  # a file that is both a training and an eval dataset: once


def _split(cfg, flag: str) -> str:
    """The split the dataset flag `flag` reads (its SPLIT_FLAGS flag, else --data.split)."""
    paths = {spec.path for spec in flag_specs(type(cfg))}
    return get_path(cfg, SPLIT_FLAGS[flag] if SPLIT_FLAGS[flag] in paths else "data.split")


def check_inputs(cfg: TrainerConfig) -> None:
    """Raise one ConfigError listing every problem of `input_problems` (nothing when all are fine)."""
    problems = input_problems(cfg)
    if problems:
        raise ConfigError.collect(problems, header="missing or broken inputs")


def check_output(path: str | None) -> None:
    """Refuse an --output that cannot be a file (a folder, or under a file) before any sampling: one line."""
    if path and os.path.isdir(path):
        raise UserError(f"--output {path} is a folder; name a .jsonl file in it, e.g. "
                        f"{os.path.join(path, 'out.jsonl')}")
    parent = os.path.dirname(os.path.abspath(path or "."))
    while path and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if path and not os.path.isdir(parent):
        raise UserError(f"--output {path}: {parent} is a file, not a folder; name a .jsonl file in a folder")


def check_sampling_inputs(cfg) -> None:
    """What `chat`, `generate` and `eval` check before the imports of sampling (torch, transformers): --output
    (`check_output`; chat has none), then every input path and data key at once (`check_inputs`)."""
    check_output(getattr(cfg, "output", None))
    check_inputs(cfg)

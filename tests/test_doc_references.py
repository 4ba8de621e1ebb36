"""What the prose names exists: every `module.name` and `path/file.py` that README.md, docs/ and the product's
comments and docstrings mention is a file of this clone and a name defined in it, so a rename that forgets a comment
fails here instead of misleading the next reader. benchmarks/RESULTS.md is a dated log (old names stay true there)
and is not read. And no doc prints an author's machine path, and README's tour names every product file."""
import ast
import dataclasses
import glob
import io
import os
import re
import shlex
import tokenize

import yaml

import wiring
from core import errors
from core.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT_DIRS = ("core", "strategies", "tasks", "resilience", "extras", "scripts")
# Config sections read like modules (`export.dir`, `train.lr`): a dotted word starting with one is a config key.
CONFIG_SECTIONS = {"data", "model", "train", "dist", "test", "export", "log", "predict", "lr_find"}
FILE_SUFFIXES = {"json", "yml", "yaml", "pt", "pt2", "txt", "md", "csv", "tsv", "log", "html", "png", "bin", "hdf5",
                 "sh", "ipynb", "gz", "distcp", "metadata", "conf", "db", "safetensors", "lock", "parquet", "npy",
                 "onnx", "jsonl"}
# Other projects' files and the kernel's cgroup files, named where we compare with them or read them.
EXTERNAL = {"train.py", "model.py", "config/train_shakespeare_char.py", "create_pretraining_data.py",
            "memory.events", "memory.oom_control"}
# Stale references in code that issue 38's restructuring rewrites (left to it, to keep the merge simple); empty
# this once that has landed.
LEFT_FOR_THE_RESTRUCTURE = set()
LR_FIND_KEYS = {"min", "max", "steps"}  # core/config.py's LRFindConfig
QUOTED_MISTAKES = {"train.lr_rate"}  # docs/config.md shows the error an unknown key gives
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+)")
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
# A constant named with its file: "tasks/sst2.py BART_PRESETS" (a preset's comment), "`wiring.py`'s `TASKS`".
PY_CONSTANT = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)(?: ([A-Z][A-Z0-9]*_[A-Z0-9_]+)\b|`'s `([A-Z][A-Z0-9_]+)`)")


def product_files() -> list[str]:
    files = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    for folder in PRODUCT_DIRS:
        files += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)]
    return sorted(files)


def all_py_files() -> set[str]:
    return {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
            if "/." not in p and "/runs/" not in p}


class Modules:
    """The project's modules by dotted path (core.config), slash path (core/config) and basename (config), each with
    the names it defines at top level and, per class, the attributes it defines or assigns to self."""

    def __init__(self):
        self.by_key: dict[str, list[str]] = {}
        self.names: dict[str, set[str]] = {}
        self.classes: dict[str, dict[str, set[str]]] = {}
        for path in sorted(all_py_files()):
            stem = path[:-3]
            for key in {stem, stem.replace("/", "."), os.path.basename(stem)}:
                self.by_key.setdefault(key, []).append(path)
            for package in (os.path.dirname(path),) if path.endswith("__init__.py") else ():
                self.by_key.setdefault(package, []).append(path)
                self.by_key.setdefault(package.replace("/", "."), []).append(path)
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            with open(os.path.join(ROOT, path)) as f:
                self._trees[path] = ast.parse(f.read())
        return self._trees[path]

    def defined(self, path: str) -> set[str]:
        if path not in self.names:
            names = set()
            for node in ast.walk(self.tree(path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in node.names)
            self.names[path] = names
        return self.names[path]

    def class_attributes(self, path: str, name: str) -> set[str] | None:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                attrs = set()
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attrs.add(sub.name)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        attrs.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        attrs.add(sub.attr)
                # An attribute may come from a base class outside this file: unknown, so accepted.
                project_bases = all(isinstance(b, ast.Name) and self.find_class(b.id) for b in node.bases)
                if not project_bases:
                    return None
                for base in node.bases:
                    more = self.class_attributes(self.find_class(base.id), base.id)
                    if more is None:
                        return None
                    attrs |= more
                return attrs
        return None

    def find_class(self, name: str) -> str | None:
        for path in sorted(all_py_files()):
            if path.startswith(("tests/", "benchmarks/", "docs/")):
                continue
            if any(isinstance(n, ast.ClassDef) and n.name == name for n in self.tree(path).body):
                return path
        return None

    def problem(self, reference: str) -> str | None:
        """None when `reference` is not about this project or names what exists; else what is missing."""
        parts = reference.split(".")
        if parts[-1] in FILE_SUFFIXES:
            return None
        if parts[0] in CONFIG_SECTIONS and not (parts[0] == "lr_find" and parts[1] not in LR_FIND_KEYS):
            return None  # a config key; lr_find is a module too (extras/lr_find.py): its other names are checked
        for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module of ours
            paths = self.by_key.get(".".join(parts[:cut]).replace(".", "/")) or self.by_key.get(".".join(parts[:cut]))
            if paths:
                name = parts[cut]
                if name == "py":
                    return None
                owners = [p for p in paths if name in self.defined(p)]
                if not owners:
                    return f"{'/'.join(parts[:cut])} has no `{name}` ({', '.join(paths)})"
                if cut + 1 < len(parts) and name[:1].isupper():
                    attrs = self.class_attributes(owners[0], name)
                    if attrs is not None and parts[cut + 1] not in attrs:
                        return f"{name} ({owners[0]}) has no attribute `{parts[cut + 1]}`"
                return None
        if reference[:1].isupper() and len(parts) == 2:  # Class.attribute
            path = self.find_class(parts[0])
            if path:
                attrs = self.class_attributes(path, parts[0])
                if attrs is not None and parts[1] not in attrs:
                    return f"{parts[0]} ({path}) has no attribute `{parts[1]}`"
        return None


def prose_of_python(path: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                line = node.body[0].lineno
                out += [(line + i, text) for i, text in enumerate(doc.splitlines())]
    return out


def prose_of_text(path: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    if path.endswith((".yml", ".yaml")):  # the comments only
        lines = [line.split("#", 1)[1] if "#" in line else "" for line in lines]
    return list(enumerate(lines, 1))


def documents() -> list[str]:
    docs = ["README.md", "parameters.yml"] + sorted(glob.glob("configs/*.yml", root_dir=ROOT))
    return docs + sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True))


def stale_references() -> list[str]:
    modules, files, stale = Modules(), all_py_files(), []
    basenames = {os.path.basename(f) for f in files}
    sources = [(p, prose_of_text(p)) for p in documents()] + [(p, prose_of_python(p)) for p in product_files()]
    for path, prose in sources:
        here = os.path.dirname(path)
        for line, text in prose:
            for ref in set(PY_PATH.findall(text)) - EXTERNAL:
                exists = (ref in files or os.path.normpath(os.path.join(here, ref)) in files
                          or ("/" not in ref and ref in basenames))
                if not exists:
                    stale.append(f"{path}:{line}: {ref} does not exist")
            for ref, *names in PY_CONSTANT.findall(text):
                owners = [f for f in files if f == os.path.normpath(os.path.join(here, ref)) or f == ref
                          or ("/" not in ref and os.path.basename(f) == ref)]
                name = "".join(names)
                if owners and not any(name in modules.defined(f) for f in owners):
                    stale.append(f"{path}:{line}: {ref} has no `{name}`")
            for ref in set(DOTTED.findall(text)) - EXTERNAL:
                if (path, ref) in LEFT_FOR_THE_RESTRUCTURE:
                    continue
                problem = modules.problem(ref)
                if problem:
                    stale.append(f"{path}:{line}: `{ref}`: {problem}")
    return stale


def test_every_module_name_and_file_named_in_docs_and_comments_exists():
    stale = stale_references()
    assert not stale, f"{len(stale)} references to what does not exist:\n" + "\n".join(stale)


def test_the_checker_catches_a_stale_reference():
    """Against names read from the code now, so that renames elsewhere leave this test as it is."""
    modules = Modules()
    function = next(n.name for n in modules.tree("resilience/launcher.py").body if isinstance(n, ast.FunctionDef))
    trainer = next(n for n in modules.tree("trainer.py").body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    method = next(n.name for n in trainer.body if isinstance(n, ast.FunctionDef))
    assert modules.problem(f"launcher.{function}") is None
    assert modules.problem(f"resilience.launcher.{function}") is None
    assert modules.problem(f"Trainer.{method}") is None
    assert "no `leave_no_trace`" in modules.problem("launcher.leave_no_trace")
    assert "no attribute `measure_everything`" in modules.problem("Trainer.measure_everything")
    assert modules.problem("train.lr") is None and modules.problem("torch.optim") is None
    assert modules.problem("meta.json") is None
    assert PY_CONSTANT.findall("sizes (tasks/sst2.py BART_PRESETS)") == [("tasks/sst2.py", "BART_PRESETS", "")]
    assert PY_CONSTANT.findall("in `wiring.py`'s `TASKS` (a subclass)") == [("wiring.py", "", "TASKS")]
    assert PY_CONSTANT.findall("benchmarks/fault_drill.py RESULTS.md, tests/test_tp.py GPT-2") == []


def prose_outside_python_blocks(path: str) -> list[tuple[int, str]]:
    """prose_of_text less the lines of ```python blocks (code, where `model.conv1` is an attribute, not a key)."""
    out, in_python = [], False
    for line, text in prose_of_text(path):
        if text.startswith("```"):
            in_python = text.startswith("```python")
        elif not in_python:
            out.append((line, text))
    return out


def unknown_config_keys() -> list[str]:
    """`section.key` in the docs and parameters.yml's comments where the section has no such field."""
    from core.config import SECTIONS
    fields = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()}
    unknown = []
    for path in documents():
        for line, text in prose_outside_python_blocks(path):
            for ref in DOTTED.findall(text):
                section, key, *rest = ref.split(".")
                if section in fields and key not in fields[section] and (rest or [key])[-1] not in FILE_SUFFIXES | {"py"} \
                        and ref not in QUOTED_MISTAKES and not key.endswith("_"):
                    unknown.append(f"{path}:{line}: `{ref}`: no such key in `{section}`")
    return unknown


def test_every_config_key_the_docs_name_exists():
    unknown = unknown_config_keys()
    assert not unknown, f"{len(unknown)} config keys that core/config.py lacks:\n" + "\n".join(unknown)


def test_docs_config_md_has_a_row_for_every_section():
    from core.config import SECTIONS
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        rows = set(re.findall(r"^\| `(\w+)` \|", f.read(), re.M))
    assert rows == set(SECTIONS), f"docs/config.md's table lacks {set(SECTIONS) - rows}"


def test_no_doc_prints_an_authors_machine_path():
    author = re.compile(r"(?<![\w.])/(?:work|Users|root|home/(?!me/|you/))[\w/.-]*")
    found = [f"{path}:{line}: {m.group(0)}" for path in documents() + ["benchmarks/RESULTS.md"]
             for line, text in prose_of_text(path) for m in author.finditer(text)]
    assert not found, "machine paths in the docs:\n" + "\n".join(found)


def test_the_readme_tour_names_every_product_file():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    tour = readme[readme.index("## A tour of the files"):readme.index("## Where to read next")]
    missing = [p for p in product_files() if not p.endswith("__init__.py")
               and f"`{p if not p.startswith('scripts/') else os.path.basename(p)}`" not in tour]
    assert not missing, f"README.md's tour does not name: {missing}"


def test_every_relative_link_of_the_docs_leads_to_a_file():
    broken = []
    for path in documents():
        if not path.endswith(".md"):
            continue
        for line, text in prose_of_text(path):
            for target in re.findall(r"\]\(([\w./-]+(?:#[\w-]*)?)\)", re.sub(r"`[^`]*`", "", text)):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                if not os.path.exists(os.path.join(ROOT, os.path.dirname(path), target.split("#")[0])):
                    broken.append(f"{path}:{line}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


# A command the docs show: `python main.py ...` to the end of the line, a `#` comment, a backtick or a table's bar.
MAIN_COMMAND = re.compile(r"main\.py(?: [^`|#]*)?")


def documented_commands() -> list[tuple[str, int, list[str], str | None]]:
    """(path, line, arguments, the error shown under it or None) of every `main.py` command of the docs, its lines
    continued with `\\` joined. Left out: commands with shell variables or `...` (their words are elsewhere), and
    those whose --params is a file of the reader's own (hetero.yml). A `--set key=K` (a placeholder) is dropped."""
    commands = []
    for path in documents():
        lines = [text for _, text in prose_of_text(path)]
        for i, text in enumerate(lines):
            joined, j = text, i
            while joined.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                joined = joined.rstrip()[:-1] + " " + lines[j].strip().lstrip("#")
            for command in MAIN_COMMAND.findall(joined):
                if "$" in command or "..." in command or "<" in command:
                    continue
                words = shlex.split(command)[1:]
                params = words[words.index("--params") + 1] if "--params" in words else "parameters.yml"
                if not re.fullmatch(r"runs/[\w-]+/config\.yml", params) and not os.path.isfile(os.path.join(ROOT, params)):
                    continue
                shown = lines[i + 1].strip() if text.lstrip().startswith("$ ") and i + 1 < len(lines) else ""
                commands.append((path, i + 1, words, shown[len("error: "):] if shown.startswith("error: ") else None))
    return commands


def preset_of(params: str) -> str:
    """The file a run's `runs/NAME/config.yml` is a copy of: the preset whose output_dir is runs/NAME."""
    if not params.startswith("runs/"):
        return params
    for preset in ["parameters.yml"] + sorted(glob.glob("configs/*.yml", root_dir=ROOT)):
        with open(os.path.join(ROOT, preset)) as f:
            if yaml.safe_load(f).get("output_dir") == os.path.dirname(params):
                return preset
    return "parameters.yml"


def test_every_command_the_docs_show_is_a_config_main_py_accepts(tmp_path, monkeypatch):
    """Each `python main.py --params P --set a.b=c ...` of README.md, docs/ and the presets' comments passes every
    check main.py makes before it starts (the schema's and wiring's), or, shown as a mistake (`$ python main.py ...`
    with `error: ...` under it), fails with the words shown. Run in a folder holding the presets, where the
    output_dir of a test-mode command has a checkpoints/ folder (what the command before it made) and pretrained/
    the folders that scripts/download_pretrained.py would fetch."""
    monkeypatch.chdir(tmp_path)
    for name in ("parameters.yml", "configs"):
        os.symlink(os.path.join(ROOT, name), name)
    os.makedirs("pretrained/bart-base")
    commands, wrong = documented_commands(), []
    assert len(commands) > 50
    for path, line, words, shown_error in commands:
        sets = [words[k + 1] for k, word in enumerate(words[:-1]) if word == "--set"
                and not re.search(r"=[A-Z]$", words[k + 1])]
        params = words[words.index("--params") + 1] if "--params" in words else "parameters.yml"
        if "mode=test" in sets:
            cfg = wiring.checked_config(preset_of(params), [s for s in sets if s != "mode=test"])
            os.makedirs(os.path.join(cfg.output_dir, "checkpoints"), exist_ok=True)
        try:
            wiring.checked_config(preset_of(params), sets)
            error = None
        except UserError as e:
            error = str(e)
        if shown_error is None and error is not None:
            wrong.append(f"{path}:{line}: main.py {' '.join(words)}\n    refused: {error}")
        elif shown_error is not None and not (error or "").startswith(shown_error.split("(...)")[0].rstrip()):
            wrong.append(f"{path}:{line}: main.py {' '.join(words)}\n    shows: {shown_error}\n    says:  {error}")
    assert not wrong, f"{len(wrong)} commands of the docs that main.py does not take as shown:\n" + "\n".join(wrong)


def test_every_exit_code_table_of_the_docs_agrees_with_core_errors():
    """docs/faults.md's and docs/slurm.md's tables of exit codes, and scripts/slurm_job.sh's summary line: the codes
    core/errors.py defines, each with the word of its meaning."""
    words = {errors.EXIT_OK: "finished", errors.EXIT_CRASH: "crash", errors.EXIT_USER_ERROR: "mistake",
             errors.EXIT_STOPPED: "stopped", errors.EXIT_DIVERGED: "diverged"}
    for path in ("docs/faults.md", "docs/slurm.md"):
        with open(os.path.join(ROOT, path)) as f:
            rows = dict(re.findall(r"^\| (\d+) \| ([^|]*)", f.read(), re.M))
        assert {int(code) for code in rows} - {130} == set(words), (path, sorted(rows))
        for code, word in words.items():
            assert word in rows[str(code)], (path, code, rows[str(code)])
    with open(os.path.join(ROOT, "scripts", "slurm_job.sh")) as f:
        summary = re.search(r"\((\d) crash, (\d) user error, (\d) diverged\)", f.read())
    assert tuple(map(int, summary.groups())) == (errors.EXIT_CRASH, errors.EXIT_USER_ERROR, errors.EXIT_DIVERGED)

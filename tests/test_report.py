"""Every figure the docs quote from a run log is what bench/report.py reads from docs/runs."""

import importlib.util
import re
import shutil

import pytest

from tests.conftest import PY, REPO, run

DOCS = ["README.md", "BENCHMARKS.md", *sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("[!.]*/README.md"))]


def copy_docs(dst):
    """The checked documents, the check and the logs it reads, as in the repository."""
    for name in (*DOCS, "bench/report.py", "docs/runs"):
        src, to = REPO / name, dst / name
        to.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, to)
    return dst


def check(repo):
    return run([PY, "bench/report.py"], cwd=repo, check=False)


def edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path.name}"
    path.write_text(text.replace(old, new))
    return text


def test_docs_match_the_logs():
    p = run([PY, "bench/report.py"])
    assert re.fullmatch(r"\d+ figures match their logs\n", p.stdout), p.stdout


@pytest.mark.parametrize(
    "doc, old, new",
    [
        ("cifar_resnet/README.md", "| 92.02 ± 0.50% | 63–67 s", "| 92.12 ± 0.50% | 63–67 s"),  # the CIFAR recipe
        ("imagenet/README.md", "about 41 min, estimated", "about 35 min, estimated"),  # the ImageNet estimate
        ("transformer/README.md", "sacreBLEU 41.95 at epoch 60", "sacreBLEU 41.59 at epoch 60"),
        ("BENCHMARKS.md", "| 1,101,059 (72.4%) |", "| 1,101,059 (79.0%) |"),
        ("BENCHMARKS.md", "| 2 | 7,773 | 97.8% |", "| 2 | 7,773 | 98.8% |"),
    ],
)
def test_a_figure_edited_by_hand_fails_the_check(tmp_path, doc, old, new):
    repo = copy_docs(tmp_path)
    text = edit(repo / doc, old, new)
    p = check(repo)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and any(x.startswith(f"{doc}: ") and "appears 0 time(s)" in x for x in lines), p.stderr
    (repo / doc).write_text(text)
    assert check(repo).returncode == 0  # the logs' figure back, and nothing else was wrong


def test_a_figure_quoted_twice_fails_when_one_copy_is_edited():
    """The count matters: a figure listed twice must stand twice as a whole (not three times, not inside a longer
    number, not as a bold figure)."""
    spec = importlib.util.spec_from_file_location("report", REPO / "bench/report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    table = [("BENCHMARKS.md", "{:,.0f}", 1234.4)] * 2 + [("BENCHMARKS.md", "{:.1f}%", 97.26)]
    assert report.check({"BENCHMARKS.md": "| 1,234 | 1,234 | 97.3% |"}, table, {}) == []
    for bad in ("| 1,234 | 1,235 | 97.3% |", "| 1,234 | 11,234 | 97.3% |", "| 1,234 | 1,234.5 | 97.3% |",
                "| 1,234 | 1,234 | 1,234 | 97.3% |", "| 1,234 | 1,234 | **97.3%** |"):  # fmt: skip
        assert report.check({"BENCHMARKS.md": bad}, table, {}), bad


def test_a_changed_log_fails_the_check(tmp_path):
    repo = copy_docs(tmp_path)
    log = repo / "docs/runs/jpeg_decode_paths_1xh200.json"
    old = edit(log, '"img_per_s": 6301.89', '"img_per_s": 6401.89')
    p = check(repo)
    assert p.returncode == 1 and "imagenet/README.md: '6,402 img/s,\\n94.0% of `--dummy`' appears 0" in p.stderr
    assert "BENCHMARKS.md: '| **6,402** | **94.0%** | 2.7 | 86% | 21% |' appears 0" in p.stderr, p.stderr
    log.write_text(old)
    (repo / "docs/runs/jpeg_dummy_2xh200.jsonl").unlink()
    p = check(repo)
    assert p.returncode == 1 and p.stderr.startswith("error: [Errno 2] No such file or directory"), p.stderr


def test_prose_holds_no_unchecked_figure_and_links_to_logs_exist(tmp_path):
    """In every checked doc, the folders' READMEs included."""
    repo = copy_docs(tmp_path)
    assert {"common/README.md", "scripts/README.md", "cifar_resnet/README.md"} < set(DOCS)
    for doc in DOCS:
        link = "../" * doc.count("/") + "docs/runs/nope.log"
        (repo / doc).write_text((repo / doc).read_text() + f"\nIt trains at 1,234 img/s ([log]({link})).\n")
    p = check(repo)
    for doc in DOCS:
        assert f"{doc}: '1,234 img/s' is no figure of bench/report.py" in p.stderr, p.stderr
        assert f"{doc}: link to docs/runs/nope.log, which does not exist" in p.stderr, p.stderr
    for doc in DOCS:
        for path in re.findall(r"\]\(((?:\.\./)?docs/runs/[^)#]+)\)", (REPO / doc).read_text()):
            assert (REPO / doc).parent.joinpath(path).exists(), f"{doc} links to {path}, which does not exist"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_name_existing_files_and_sections():
    for doc in map(REPO.joinpath, DOCS):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path, _, anchor = target.partition("#")
            linked = doc.parent / path if path else doc
            assert target.startswith("http") or linked.exists(), f"{doc.relative_to(REPO)} links to {target}"
            if anchor and not target.startswith("http"):
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
                assert anchor in anchors, f"{doc.relative_to(REPO)} links to {target}, not a section"

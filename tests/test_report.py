"""The figures in README.md and BENCHMARKS.md are what bench/report.py computes from the logs in docs/runs."""

import re
import shutil

from tests.conftest import PY, REPO, run

MARKED = re.compile(r"<!-- report:([\w-]+) -->\n.*?<!-- /report:\1 -->", re.S)


def copy_docs(dst):
    """The two documents, the report script and the logs it reads, as in the repository."""
    for name in ("README.md", "BENCHMARKS.md", "bench/report.py", "docs/runs"):
        src, to = REPO / name, dst / name
        to.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, to)
    return dst


def test_docs_match_the_logs():
    run([PY, "bench/report.py", "--check"])


def test_a_figure_edited_by_hand_fails_the_check(tmp_path):
    repo = copy_docs(tmp_path)
    readme = repo / "README.md"
    text = readme.read_text()
    m = re.search(r"92\.02 ± 0\.50", text)
    assert m, "the CIFAR headline figure is not in README.md"
    readme.write_text(text[: m.start()] + "92.12 ± 0.50" + text[m.end() :])
    p = run([PY, "bench/report.py", "--check"], cwd=repo, check=False)
    assert p.returncode == 1 and "README.md: block 'readme-results' differs" in p.stderr, p.stderr
    run([PY, "bench/report.py", "--write"], cwd=repo)
    assert readme.read_text() == text  # --write puts the logs' figure back, and nothing else changes


def test_a_changed_log_fails_the_check(tmp_path):
    repo = copy_docs(tmp_path)
    log = repo / "docs/runs/jpeg_decode_paths_1xh200.json"
    old = log.read_text()
    log.write_text(old.replace('"img_per_s": 6301.89', '"img_per_s": 6401.89'))
    assert log.read_text() != old
    p = run([PY, "bench/report.py", "--check"], cwd=repo, check=False)
    assert p.returncode == 1 and "block 'rn50-jpeg' differs" in p.stderr, p.stderr


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_benchmarks_md_name_its_sections():
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", (REPO / "BENCHMARKS.md").read_text(), re.M)}
    for doc in REPO.glob("*/README.md"):
        for anchor in re.findall(r"BENCHMARKS\.md#([\w-]+)", doc.read_text()):
            assert anchor in anchors, f"{doc.relative_to(REPO)} links to BENCHMARKS.md#{anchor}, not a section"


def test_links_to_run_logs_exist_and_prose_holds_no_figure():
    for doc in ("README.md", "BENCHMARKS.md"):
        text = (REPO / doc).read_text()
        for path in re.findall(r"\]\((docs/runs/[^)#]+)\)", text):
            assert (REPO / path).exists(), f"{doc} links to {path}, which does not exist"
    # Throughput and percentages outside the generated blocks would be typed by hand: they belong in a block.
    prose = MARKED.sub("", (REPO / "BENCHMARKS.md").read_text())
    figures = re.findall(r"\b\d[\d,.]*\s?(?:%|img/s|tok/s|tokens/s)", prose)
    assert not figures, f"BENCHMARKS.md has figures outside the generated blocks: {figures}"

"""Reading the files of deploy/ for the tests: the worker's command line in each, the PromQL of the
alert rules and the dashboard, a PromQL shape check, a Dockerfile and a systemd unit parser.

Used by tests/unit/test_deploy_files.py (no broker) and tests/integration/test_deployment.py (a
real worker). Pure Python and PyYAML: no Prometheus, Docker or systemd needed.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "systemd" / "kombu-events-worker.service"
DEPLOYMENT = DEPLOY / "kubernetes" / "deployment.yaml"
SCALEDOBJECT = DEPLOY / "kubernetes" / "keda-scaledobject.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "kombu-events.json"
EXAMPLE_APP = DEPLOY / "example" / "events_app.py"

#: What every worker command of deploy/ runs, in this order (the port is METRICS_PORT).
WORKER_ARGS = ["-A", "events_app", "worker", "--with-events-step", "--events-metrics-port"]
METRICS_PORT = 9808


def data_files() -> list[Path]:
    """Every YAML and JSON file under deploy/."""
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def load(path: Path) -> list[Any]:
    """The documents of a YAML file (several, ``---``-separated) or the one of a JSON file."""
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def by_kind(path: Path, kind: str) -> dict[str, Any]:
    """The one document of ``kind`` in a Kubernetes YAML file."""
    found = [doc for doc in load(path) if doc.get("kind") == kind]
    assert len(found) == 1, f"{path.name}: {len(found)} documents of kind {kind}"
    return found[0]


# -- the worker's command line in each file -------------------------------------------------------

def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment's one container."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, containers
    return containers[0]


def kubernetes_command() -> list[str]:
    """The worker container's command (the image has no ENTRYPOINT: this is what runs)."""
    spec = container(by_kind(DEPLOYMENT, "Deployment"))
    return [str(a) for a in spec.get("command", []) + spec.get("args", [])]


def kubernetes_env() -> dict[str, Any]:
    """The container's environment: plain values, and ``valueFrom`` entries as they are."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(by_kind(DEPLOYMENT, "Deployment"))["env"]}


def unit_entries(path: Path = UNIT) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit's ``{section: [(key, value), ...]}`` (keys may repeat, as in ``Environment=``)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None and "=" in line, f"{path.name}:{number}: not a Key=value line in a section: {raw}"
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def unit_value(section: str, key: str, path: Path = UNIT) -> str:
    """The last value of ``key`` in ``section`` (as systemd takes it for single-valued keys)."""
    values = [v for k, v in unit_entries(path).get(section, []) if k == key]
    assert values, f"{path.name}: no {key}= in [{section}]"
    return values[-1]


def unit_command() -> list[str]:
    """``ExecStart=`` split as systemd splits it (no variables are used there)."""
    return shlex.split(unit_value("Service", "ExecStart"))


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments), ...]``: comments and parser directives left out, continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continuation is dropped
            continue
        pending += (" " if pending else "") + stripped
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return instructions


def dockerfile_cmd() -> list[str]:
    """The image's ``CMD`` (exec form: a JSON array)."""
    cmds = [args for word, args in dockerfile_instructions() if word == "CMD"]
    assert len(cmds) == 1, cmds
    return list(json.loads(cmds[0]))


def worker_commands() -> dict[str, list[str]]:
    """The worker's argv in each file that starts one."""
    return {"Dockerfile CMD": dockerfile_cmd(), "systemd ExecStart": unit_command(),
            "Kubernetes command": kubernetes_command()}


# -- PromQL -----------------------------------------------------------------------------------------

def alert_rules() -> list[dict[str, Any]]:
    """Every rule of every group of the alerts file."""
    (doc,) = load(ALERTS)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """``(where, query)`` for every panel target and templating query of the dashboard (Grafana's form)."""
    (dash,) = load(DASHBOARD)
    found = [(f"panel {p['title']!r} target {t['refId']}", t["expr"])
             for p in dash["panels"] for t in p.get("targets", [])]
    for variable in dash.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query":
            found.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    return found


def dashboard_promql() -> list[tuple[str, str]]:
    """The dashboard's panel queries as plain PromQL: Grafana's variables replaced by values of theirs."""
    replacements = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$service": ".*"}
    out = []
    for where, query in dashboard_queries():
        if where.startswith("variable"):
            continue  # label_values(...) is Grafana's, not PromQL
        for variable, value in replacements.items():
            query = query.replace(variable, value)
        assert "$" not in query, f"{where}: a Grafana variable the tests do not know: {query}"
        out.append((where, query))
    return out


def queried_metrics() -> dict[str, set[str]]:
    """``{metric name: {where it is used}}`` over the alert rules and the dashboard (queries and variables)."""
    found: dict[str, set[str]] = {}
    sources = [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()] + dashboard_queries()
    for where, expr in sources:
        for name in metric_names(expr):
            found.setdefault(name, set()).add(where)
    return found


METRIC = re.compile(r"\bkombu_events_[a-z0-9_]+\b")


def metric_names(expr: str) -> set[str]:
    """The ``kombu_events_...`` series an expression names, as they appear in it."""
    return set(METRIC.findall(_strings_blanked(expr)))


def family(sample_name: str) -> str:
    """The metric family of a sample name: ``_bucket``/``_count``/``_sum`` (histogram), ``_total`` (counter) off."""
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def exposed_samples(text: str) -> dict[str, set[str]]:
    """``{sample name: {label names}}`` of a Prometheus text exposition (``/metrics``)."""
    samples: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*?)\})?\s", line)
        assert match, f"not a sample line: {line}"
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(3) or ""))
        samples.setdefault(match.group(1), set()).update(labels)
    return samples


FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time", "ceil",
    "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_count", "histogram_fraction",
    "histogram_quantile", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time",
    "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", *GROUPING}
MATCH_OPS = {"=", "!=", "=~", "!~"}
BINARY_OPS = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)
  | (?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=])
  | (?P<punct>[(){}\[\],:])
  | (?P<space>\s+)
  | (?P<bad>.)
""", re.VERBOSE)


def _tokens(expr: str) -> list[tuple[str, str]]:
    return [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "space"]


def _strings_blanked(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)


def promql_problems(expr: str, labels: set[str] | None = None) -> list[str]:
    """What is wrong with the shape of a PromQL expression; [] when nothing is found.

    Checks brackets (balanced and nested), that every call is a known function or aggregation,
    label matchers (``name op "string"``, names among ``labels`` if given), label lists of
    ``by``/``on``/..., range durations, and that every bare name is a ``kombu_events_`` metric.
    Not a parser: it catches typos and broken edits, promtool checks the rest where installed.
    """
    problems: list[str] = []
    tokens = _tokens(expr)
    if not tokens:
        return ["empty expression"]
    stack: list[str] = []
    pairs = {")": "(", "}": "{", "]": "["}
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "bad":
            problems.append(f"unexpected character {text!r}")
        elif kind == "punct" and text in "({[":
            stack.append(text)
            if text == "{":
                j, found = _matchers(tokens, i + 1, labels)
                problems += found
                i = j
                continue
            if text == "[":
                j = i + 1
                window = []
                while j < len(tokens) and tokens[j][1] != "]":
                    window.append(tokens[j])
                    j += 1
                shape = [k if k == "duration" else t for k, t in window]
                if shape not in (["duration"], ["duration", ":"], ["duration", ":", "duration"]):
                    problems.append(f"range [{''.join(t for _k, t in window)}] is not a duration (or subquery)")
                i = j
                continue
        elif kind == "punct" and text in ")}]":
            if not stack or stack[-1] != pairs[text]:
                problems.append(f"unbalanced {text!r}")
            else:
                stack.pop()
        elif kind == "ident":
            if after == "(":
                if text in GROUPING:
                    j, found = _label_list(tokens, i + 2, labels)
                    problems += found
                    i = j + 1
                    continue
                if text not in FUNCTIONS | AGGREGATIONS:
                    problems.append(f"unknown function {text}()")
            elif text in AGGREGATIONS and after in GROUPING:
                pass  # sum by (a) (...)
            elif text not in KEYWORDS and not text.startswith("kombu_events_"):
                problems.append(f"{text!r} is neither a kombu_events_ metric nor a PromQL keyword")
        i += 1
    if stack:
        problems.append(f"unclosed {''.join(stack)!r}")
    return problems


def _matchers(tokens: list[tuple[str, str]], i: int, labels: set[str] | None) -> tuple[int, list[str]]:
    """Check ``name op "value", ...`` up to the closing brace; the index after it."""
    problems = []
    while i < len(tokens) and tokens[i][1] != "}":
        group = tokens[i:i + 3]
        if (len(group) < 3 or group[0][0] != "ident" or group[1][1] not in MATCH_OPS or group[2][0] != "string"):
            problems.append(f"bad label matcher near {' '.join(t for _k, t in group)!r}")
            while i < len(tokens) and tokens[i][1] not in (",", "}"):
                i += 1
        else:
            if labels is not None and group[0][1] not in labels:
                problems.append(f"label {group[0][1]!r} is not one the metrics have ({sorted(labels)})")
            i += 3
        if i < len(tokens) and tokens[i][1] == ",":
            i += 1
        elif i < len(tokens) and tokens[i][1] != "}":
            problems.append(f"bad label matcher near {tokens[i][1]!r}: ',' or '}}' expected")
    if i >= len(tokens):
        return i, [*problems, "unclosed '{'"]
    return i, problems  # at the closing brace: the caller pops it


def _label_list(tokens: list[tuple[str, str]], i: int, labels: set[str] | None) -> tuple[int, list[str]]:
    """Check ``(a, b)`` after a grouping keyword; the index of the closing parenthesis."""
    problems = []
    while i < len(tokens) and tokens[i][1] != ")":
        kind, text = tokens[i]
        if kind == "ident":
            if labels is not None and text not in labels:
                problems.append(f"label {text!r} is not one the metrics have ({sorted(labels)})")
        elif text != ",":
            problems.append(f"{text!r} in a label list")
        i += 1
    if i >= len(tokens):
        problems.append("unclosed label list")
    return i, problems


def rule_file_of(queries: list[tuple[str, str]]) -> str:
    """A Prometheus rule file recording each query: for ``promtool check rules`` on the dashboard's PromQL."""
    rules = [{"record": f"dashboard:query_{n}", "expr": expr} for n, (_where, expr) in enumerate(queries)]
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False)


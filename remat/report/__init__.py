"""Reports of a planned step. One data type, `Report` (built by `build_report` from a
`PlannedStep`), read by every writer: `text.render`, `to_json.write_json`,
`html.write_html`, `plots` (PNG). `summary` is the short text of `Planned.summary()`,
`text.backend_summary` that of `remat.backend(...).summary()`."""

from remat.report.text import summary

__all__ = ["summary"]

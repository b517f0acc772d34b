"""Reports of a planned step, read from one data type (`PlannedStep`)."""

from remat.report.text import summary

__all__ = ["summary"]

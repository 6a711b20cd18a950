"""Rendering: terminal tables, the chart page, figures and markdown reports. Computes nothing itself."""

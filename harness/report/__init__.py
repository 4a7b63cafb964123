"""Human-readable reports of a bundle: markdown for a PR comment, one self-contained HTML page."""

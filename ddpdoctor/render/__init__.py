"""Output of an analysed run: text, JSON, the self-contained HTML report and the Chrome Trace
Event timeline. Never imports ``ddpdoctor.rank``."""

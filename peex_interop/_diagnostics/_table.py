"""Tables of results (summaries, alignments, comparisons, recorders): one renderer for
the terminal (`print`, IPython), rich, and notebooks (HTML)."""

import abc
import dataclasses
import html
from typing import Any


@dataclasses.dataclass(frozen=True)
class Table:
    """Cells as strings, a caption (a verdict or a total), and the columns that hold
    numbers (aligned right)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    caption: str
    numeric: frozenset[int] = frozenset()

    def __str__(self) -> str:
        cells = [self.header, *self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.header))]
        def line(row: tuple[str, ...]) -> str:
            padded = (c.rjust(w) if i in self.numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            return "  ".join(padded).rstrip()

        lines = [line(row) for row in cells]
        rule = "-" * max(len(line) for line in lines)
        return "\n".join([lines[0], rule, *lines[1:], self.caption])

    def __rich__(self) -> Any:
        from rich.table import Table as RichTable

        table = RichTable(caption=self.caption)
        for i, name in enumerate(self.header):
            table.add_column(name, justify="right" if i in self.numeric else "left")
        for row in self.rows:
            table.add_row(*row)
        return table

    def _repr_html_(self) -> str:
        def cells(tag: str, row: tuple[str, ...]) -> str:
            return "".join(
                f'<{tag} style="text-align: {"right" if i in self.numeric else "left"}">{html.escape(c)}</{tag}>'
                for i, c in enumerate(row)
            )

        body = "".join(f"<tr>{cells('td', row)}</tr>" for row in self.rows)
        return (
            f"<table><caption>{html.escape(self.caption)}</caption>"
            f"<thead><tr>{cells('th', self.header)}</tr></thead><tbody>{body}</tbody></table>"
        )


class AbstractTabular(abc.ABC):
    """A result shown as its `Table` everywhere: `print`, the Python and IPython prompts,
    rich, and notebooks."""

    @abc.abstractmethod
    def _table(self) -> Table:
        """The result as a `Table` of strings."""

    # The table is the repr too (as a pandas DataFrame's), so that the Python and IPython
    # prompts show it; dataclass subclasses pass `repr=False` to keep it.
    def __repr__(self) -> str:
        return str(self._table())

    def __rich__(self) -> Any:
        return self._table().__rich__()

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()

"""Parquet sources: records with a text column (tokenized on the worker) or a list<int> column of
token ids, and for multimodal rows a ``list<binary>`` of encoded images and a ``list<int>`` of the
text positions they go to (``records.py`` turns them into a block).

Units come from the footers: each row group, cut into ranges of at most ``loading.unit_rows`` rows.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SourceError
from ..plan import Source, SourcePlan
from .formats import Format
from .fs import is_local, list_files, per_file, source_fs
from .records import check_schema
from .units import LoadUnit


def _open(fs, path: str, source: Source) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(fs.open(path, "rb"), page_checksum_verification=True)
    except FileNotFoundError:
        raise SourceError(f"source {source.name!r}: file not found: {path}") from None
    except (pa.ArrowInvalid, OSError) as err:
        raise SourceError(f"source {source.name!r}: corrupt or unreadable parquet file {path}: {err}") from None


def _row_groups(fs, path: str, source: Source) -> list[int]:
    """Rows per row group of one file, from its footer (its schema checked, unless prepare steps
    may make the fields)."""
    pf = _open(fs, path, source)
    if not source.prepare:
        check_schema(source, path, pf.schema_arrow)
    md = pf.metadata
    return [md.row_group(rg).num_rows for rg in range(md.num_row_groups)]


class ParquetFormat(Format):
    name = "parquet"
    suffixes = (".parquet",)

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        """Units from the files' footers only (no data pages); the order is the sorted file order
        whatever the timing; on remote storage the footers are read in parallel (``fs.per_file``)."""
        fs, files = list_files(source, plan.base_dir, self.suffixes)
        groups = per_file(lambda p: _row_groups(fs, p, source), files, not is_local(source, plan.base_dir))
        units: list[LoadUnit] = []
        first_id = 0
        step = plan.loading.unit_rows
        for path, rows_per_group in zip(files, groups):
            for rg, rows in enumerate(rows_per_group):
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    units.append(LoadUnit(source.name, len(units), path, rg, start, stop, first_id + start))
                first_id += rows
        return units

    def regions(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> list[tuple[str, int, int | None]]:
        """The unit's row group: from its first column chunk's first page to its last chunk's end."""
        fs, _ = source_fs(source, plan.base_dir)
        rg = _open(fs, unit.path, source).metadata.row_group(unit.part)
        lo, hi = None, 0
        for c in range(rg.num_columns):
            col = rg.column(c)
            start = (
                col.dictionary_page_offset
                if col.has_dictionary_page and col.dictionary_page_offset
                else col.data_page_offset
            )
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + col.total_compressed_size)
        return [(unit.path, int(lo or 0), int(hi))]

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        fs, _ = source_fs(source, plan.base_dir)
        pf = _open(fs, unit.path, source)
        if not source.prepare:
            check_schema(source, unit.path, pf.schema_arrow)
        try:
            table = pf.read_row_group(unit.part, columns=self.columns(source))
        except (pa.ArrowInvalid, OSError) as err:
            raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
        return table.slice(unit.start, unit.n_docs)

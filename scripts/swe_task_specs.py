"""The shipped SWE tasks, as source: small Python repositories, each with one realistic bug.

Each `Spec` is a repository (`files`, with the tests a maintainer would already have in
`visible_tests`), the issue a user filed, the reference fix (`fix`: exact text replacements, each
of which must occur exactly once) and the hidden tests (`hidden_tests`: the final content of each
test file after the fix's test patch). scripts/make_swe_tasks.py turns them into instances and
works out FAIL_TO_PASS and PASS_TO_PASS by running the tests before and after the fix. To add a
task, append a Spec and rerun the generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from textwrap import dedent


@dataclass(frozen=True)
class Spec:
    id: str
    issue: str
    files: dict[str, str]
    fix: list[tuple[str, str, str]]
    hidden_tests: dict[str, str]
    visible_tests: dict[str, str] = field(default_factory=dict)


def d(text: str) -> str:
    return dedent(text).lstrip("\n")


SPECS: list[Spec] = []


def spec(**kwargs) -> None:
    SPECS.append(Spec(**{k: (d(v) if k == "issue" else v) for k, v in kwargs.items()}))


# ── 1 ───────────────────────────────────────────────────────────────────────────────────────
_SLUG = d('''
    """URL slugs for titles."""
    import re
    import unicodedata


    def slugify(title: str, sep: str = "-") -> str:
        """Lower-case ASCII words of `title` joined by `sep`."""
        text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
        text = re.sub(r"[^a-zA-Z0-9]", sep, text.lower())
        return text
''')
_SLUG_TESTS = d('''
    from textkit.slug import slugify


    def test_simple_words():
        assert slugify("Hello World") == "hello-world"


    def test_accents_are_dropped():
        assert slugify("Café") == "cafe"
''')
spec(
    id="textkit__slugify-separators",
    issue='''
        slugify leaves runs of separators and leading/trailing dashes

        `slugify("  Hello,   World! ")` returns `"--hello----world--"`. I expected `"hello-world"`:
        punctuation and whitespace runs should become a single separator, and the slug should not
        start or end with one. Same with a custom separator: `slugify("a  b", sep="_")` gives `"a__b"`.
    ''',
    files={"textkit/__init__.py": "", "textkit/slug.py": _SLUG},
    visible_tests={"tests/test_slug.py": _SLUG_TESTS},
    fix=[("textkit/slug.py", '''    text = re.sub(r"[^a-zA-Z0-9]", sep, text.lower())
    return text
''', '''    text = re.sub(r"[^a-zA-Z0-9]+", sep, text.lower())
    return text.strip(sep)
''')],
    hidden_tests={"tests/test_slug.py": _SLUG_TESTS + d('''


        def test_runs_of_punctuation_collapse():
            assert slugify("  Hello,   World! ") == "hello-world"


        def test_custom_separator_collapses():
            assert slugify("a  b", sep="_") == "a_b"
    ''')},
)

# ── 2 ───────────────────────────────────────────────────────────────────────────────────────
_STATS = d('''
    """Small descriptive statistics without numpy."""


    def mean(values):
        values = list(values)
        if not values:
            raise ValueError("mean of an empty sequence")
        return sum(values) / len(values)


    def median(values):
        ordered = sorted(values)
        if not ordered:
            raise ValueError("median of an empty sequence")
        return ordered[len(ordered) // 2]
''')
_STATS_TESTS = d('''
    from statlite.core import mean, median


    def test_mean():
        assert mean([1, 2, 3, 4]) == 2.5


    def test_median_odd():
        assert median([3, 1, 2]) == 2
''')
spec(
    id="statlite__median-even",
    issue='''
        median() is wrong for an even number of values

        `median([1, 2, 3, 4])` returns `3`, but the median of an even-length sample is the mean of the
        two middle values, `2.5`. `median([10, 20])` returns `20` instead of `15.0`.
    ''',
    files={"statlite/__init__.py": "", "statlite/core.py": _STATS},
    visible_tests={"tests/test_core.py": _STATS_TESTS},
    fix=[("statlite/core.py", '''        raise ValueError("median of an empty sequence")
    return ordered[len(ordered) // 2]
''', '''        raise ValueError("median of an empty sequence")
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
''')],
    hidden_tests={"tests/test_core.py": _STATS_TESTS + d('''


        def test_median_even():
            assert median([1, 2, 3, 4]) == 2.5
            assert median([20, 10]) == 15.0
    ''')},
)

# ── 3 ───────────────────────────────────────────────────────────────────────────────────────
_CAL = d('''
    """Calendar helpers."""


    def is_leap_year(year: int) -> bool:
        return year % 4 == 0 and year % 100 != 0


    def days_in_month(year: int, month: int) -> int:
        if month == 2:
            return 29 if is_leap_year(year) else 28
        return 30 if month in (4, 6, 9, 11) else 31
''')
_CAL_TESTS = d('''
    from calendarx.days import days_in_month, is_leap_year


    def test_common_years():
        assert not is_leap_year(2023)
        assert is_leap_year(2024)
        assert not is_leap_year(1900)


    def test_days_in_month():
        assert days_in_month(2023, 2) == 28
        assert days_in_month(2023, 4) == 30
''')
spec(
    id="calendarx__leap-400",
    issue='''
        February 2000 has 29 days, calendarx says 28

        `days_in_month(2000, 2)` returns 28 and `is_leap_year(2000)` is False. Years divisible by 400
        are leap years in the Gregorian calendar (2000, 2400), even though they are divisible by 100.
    ''',
    files={"calendarx/__init__.py": "", "calendarx/days.py": _CAL},
    visible_tests={"tests/test_days.py": _CAL_TESTS},
    fix=[("calendarx/days.py", "    return year % 4 == 0 and year % 100 != 0\n",
          "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n")],
    hidden_tests={"tests/test_days.py": _CAL_TESTS + d('''


        def test_divisible_by_400_is_leap():
            assert is_leap_year(2000)
            assert days_in_month(2000, 2) == 29
    ''')},
)

# ── 4 ───────────────────────────────────────────────────────────────────────────────────────
_PAGES = d('''
    """Pagination of result lists."""


    def page_count(total: int, per_page: int) -> int:
        if per_page <= 0:
            raise ValueError("per_page must be positive")
        return total // per_page


    def page(items: list, number: int, per_page: int) -> list:
        """Items of the 1-based page `number`."""
        start = (number - 1) * per_page
        return items[start:start + per_page]
''')
_PAGES_TESTS = d('''
    from pager.pages import page, page_count


    def test_exact_pages():
        assert page_count(20, 10) == 2


    def test_page_slices():
        assert page(list(range(25)), 3, 10) == [20, 21, 22, 23, 24]
''')
spec(
    id="pager__page-count-remainder",
    issue='''
        Last page missing when total is not a multiple of per_page

        With 25 results and 10 per page, `page_count(25, 10)` returns 2 so our UI never links to page 3,
        which holds results 21-25. The count should round up. (0 results should still be 0 pages.)
    ''',
    files={"pager/__init__.py": "", "pager/pages.py": _PAGES},
    visible_tests={"tests/test_pages.py": _PAGES_TESTS},
    fix=[("pager/pages.py", "    return total // per_page\n", "    return -(-total // per_page)\n")],
    hidden_tests={"tests/test_pages.py": _PAGES_TESTS + d('''


        def test_partial_last_page_counts():
            assert page_count(25, 10) == 3
            assert page_count(1, 10) == 1
            assert page_count(0, 10) == 0
    ''')},
)

# ── 5 ───────────────────────────────────────────────────────────────────────────────────────
_CONF = d('''
    """Typed values from environment-style settings."""

    _TRUE = {"1", "true", "yes", "on"}
    _FALSE = {"0", "false", "no", "off"}


    def parse_bool(value: str) -> bool:
        text = value.strip()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"not a boolean: {value!r}")


    def parse_list(value: str) -> list[str]:
        return [part.strip() for part in value.split(",") if part.strip()]
''')
_CONF_TESTS = d('''
    import unittest

    from envconf.values import parse_bool, parse_list


    class ParseTests(unittest.TestCase):
        def test_lower_case_booleans(self):
            self.assertTrue(parse_bool("yes"))
            self.assertFalse(parse_bool(" off "))

        def test_lists(self):
            self.assertEqual(parse_list("a, b,,c"), ["a", "b", "c"])
''')
spec(
    id="envconf__bool-case",
    issue='''
        parse_bool rejects "True" and "FALSE"

        Settings written by other tools use capitalised booleans. `parse_bool("True")` raises
        `ValueError: not a boolean: 'True'`, and so does `"FALSE"`. Booleans should be case-insensitive.
    ''',
    files={"envconf/__init__.py": "", "envconf/values.py": _CONF},
    visible_tests={"tests/test_values.py": _CONF_TESTS},
    fix=[("envconf/values.py", "    text = value.strip()\n", "    text = value.strip().lower()\n")],
    hidden_tests={"tests/test_values.py": _CONF_TESTS + (
        "\n"
        "    def test_case_insensitive(self):\n"
        "        self.assertTrue(parse_bool(\"True\"))\n"
        "        self.assertFalse(parse_bool(\"FALSE\"))\n"
        "        with self.assertRaises(ValueError):\n"
        "            parse_bool(\"maybe\")\n"
    )},
)

# ── 6 ───────────────────────────────────────────────────────────────────────────────────────
_LRU = d('''
    """A small least-recently-used cache."""
    from collections import OrderedDict


    class LRUCache:
        def __init__(self, capacity: int) -> None:
            if capacity < 1:
                raise ValueError("capacity must be at least 1")
            self.capacity = capacity
            self._data = OrderedDict()

        def get(self, key, default=None):
            if key not in self._data:
                return default
            return self._data[key]

        def put(self, key, value) -> None:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.capacity:
                self._data.popitem(last=False)

        def __len__(self) -> int:
            return len(self._data)
''')
_LRU_TESTS = d('''
    from cachetools_lite.lru import LRUCache


    def test_put_and_get():
        c = LRUCache(2)
        c.put("a", 1)
        assert c.get("a") == 1
        assert c.get("zzz", 0) == 0


    def test_capacity_is_kept():
        c = LRUCache(2)
        for k in "abc":
            c.put(k, k)
        assert len(c) == 2 and c.get("a") is None
''')
spec(
    id="cachetools_lite__lru-get-recency",
    issue='''
        LRUCache evicts an entry that was just read

        ```python
        c = LRUCache(2)
        c.put("a", 1); c.put("b", 2)
        c.get("a")          # "a" is now the most recently used
        c.put("c", 3)
        c.get("a")          # -> None, but "b" should have been evicted
        ```
        Reading a key should count as using it.
    ''',
    files={"cachetools_lite/__init__.py": "", "cachetools_lite/lru.py": _LRU},
    visible_tests={"tests/test_lru.py": _LRU_TESTS},
    fix=[("cachetools_lite/lru.py", '''            return default
        return self._data[key]
''', '''            return default
        self._data.move_to_end(key)
        return self._data[key]
''')],
    hidden_tests={"tests/test_lru.py": _LRU_TESTS + d('''


        def test_get_refreshes_recency():
            c = LRUCache(2)
            c.put("a", 1)
            c.put("b", 2)
            assert c.get("a") == 1
            c.put("c", 3)
            assert c.get("a") == 1
            assert c.get("b") is None
    ''')},
)

# ── 7 ───────────────────────────────────────────────────────────────────────────────────────
_CSV = d('''
    """Split one line of comma-separated values."""


    def split_line(line: str, delimiter: str = ",") -> list[str]:
        fields = []
        current = ""
        in_quotes = False
        for ch in line:
            if ch == '"':
                in_quotes = not in_quotes
            elif ch == delimiter:
                fields.append(current)
                current = ""
            else:
                current += ch
        fields.append(current)
        return fields
''')
_CSV_TESTS = d('''
    from minicsv.split import split_line


    def test_plain_fields():
        assert split_line("a,b,c") == ["a", "b", "c"]


    def test_empty_fields():
        assert split_line("a,,c") == ["a", "", "c"]


    def test_quotes_are_removed():
        assert split_line('"a",b') == ["a", "b"]
''')
spec(
    id="minicsv__quoted-delimiter",
    issue='''
        Commas inside quoted fields split the field

        `split_line('name,"Doe, Jane",42')` returns `['name', 'Doe', ' Jane', '42']`; a delimiter inside
        double quotes is part of the field, so it should be `['name', 'Doe, Jane', '42']`.
    ''',
    files={"minicsv/__init__.py": "", "minicsv/split.py": _CSV},
    visible_tests={"tests/test_split.py": _CSV_TESTS},
    fix=[("minicsv/split.py", "        elif ch == delimiter:\n", "        elif ch == delimiter and not in_quotes:\n")],
    hidden_tests={"tests/test_split.py": _CSV_TESTS + d('''


        def test_delimiter_inside_quotes():
            assert split_line('name,"Doe, Jane",42') == ["name", "Doe, Jane", "42"]
    ''')},
)

# ── 8 ───────────────────────────────────────────────────────────────────────────────────────
_ITER = d('''
    """Iteration helpers."""


    def chunks(seq, size: int):
        """Consecutive slices of `seq` of length `size` (the last may be shorter)."""
        if size < 1:
            raise ValueError("size must be at least 1")
        out = []
        for start in range(0, len(seq) - size + 1, size):
            out.append(seq[start:start + size])
        return out
''')
_ITER_TESTS = d('''
    from itertools_plus.chunking import chunks


    def test_even_split():
        assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


    def test_strings():
        assert chunks("abcd", 2) == ["ab", "cd"]
''')
spec(
    id="itertools_plus__chunks-tail",
    issue='''
        chunks() silently drops the last partial chunk

        The docstring says the last chunk may be shorter, but `chunks([1, 2, 3, 4, 5], 2)` returns
        `[[1, 2], [3, 4]]` and the 5 is lost. Expected `[[1, 2], [3, 4], [5]]`.
    ''',
    files={"itertools_plus/__init__.py": "", "itertools_plus/chunking.py": _ITER},
    visible_tests={"tests/test_chunking.py": _ITER_TESTS},
    fix=[("itertools_plus/chunking.py", "    for start in range(0, len(seq) - size + 1, size):\n",
          "    for start in range(0, len(seq), size):\n")],
    hidden_tests={"tests/test_chunking.py": _ITER_TESTS + d('''


        def test_partial_tail_is_kept():
            assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
            assert chunks([1], 3) == [[1]]
    ''')},
)

# ── 9 ───────────────────────────────────────────────────────────────────────────────────────
_MERGE = d('''
    """Merging nested configuration dictionaries."""


    def deep_merge(base: dict, override: dict) -> dict:
        """A new dict: `base` updated with `override`, merging nested dicts key by key."""
        result = dict(base)
        for key, value in override.items():
            result[key] = value
        return result
''')
_MERGE_TESTS = d('''
    from dictutils.merge import deep_merge


    def test_flat_override():
        assert deep_merge({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}


    def test_inputs_untouched():
        base = {"a": 1}
        deep_merge(base, {"a": 2})
        assert base == {"a": 1}
''')
spec(
    id="dictutils__deep-merge-nested",
    issue='''
        deep_merge replaces nested dicts instead of merging them

        ```python
        deep_merge({"db": {"host": "x", "port": 5432}}, {"db": {"port": 6543}})
        # -> {"db": {"port": 6543}}   (host is gone)
        ```
        Expected `{"db": {"host": "x", "port": 6543}}`, at any depth, without modifying the inputs.
    ''',
    files={"dictutils/__init__.py": "", "dictutils/merge.py": _MERGE},
    visible_tests={"tests/test_merge.py": _MERGE_TESTS},
    fix=[("dictutils/merge.py", '''        result[key] = value
''', '''        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = value
''')],
    hidden_tests={"tests/test_merge.py": _MERGE_TESTS + d('''


        def test_nested_dicts_merge():
            base = {"db": {"host": "x", "port": 5432, "opts": {"ssl": True}}}
            merged = deep_merge(base, {"db": {"port": 6543, "opts": {"timeout": 3}}})
            assert merged == {"db": {"host": "x", "port": 6543, "opts": {"ssl": True, "timeout": 3}}}
            assert base["db"] == {"host": "x", "port": 5432, "opts": {"ssl": True}}
    ''')},
)

# ── 10 ──────────────────────────────────────────────────────────────────────────────────────
_ROMAN = d('''
    """Roman numerals."""

    _VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


    def roman_to_int(numeral: str) -> int:
        total = 0
        for ch in numeral.upper():
            if ch not in _VALUES:
                raise ValueError(f"not a roman digit: {ch!r}")
            total += _VALUES[ch]
        return total
''')
_ROMAN_TESTS = d('''
    from numerals.roman import roman_to_int


    def test_additive():
        assert roman_to_int("VIII") == 8
        assert roman_to_int("mdclxvi") == 1666


    def test_rejects_other_letters():
        try:
            roman_to_int("IIZ")
        except ValueError:
            return
        raise AssertionError("no ValueError")
''')
spec(
    id="numerals__subtractive",
    issue='''
        roman_to_int ignores subtractive notation

        `roman_to_int("IV")` returns 6 and `roman_to_int("MCMXCIV")` returns 2216; they should be 4 and
        1994. A smaller digit before a larger one is subtracted.
    ''',
    files={"numerals/__init__.py": "", "numerals/roman.py": _ROMAN},
    visible_tests={"tests/test_roman.py": _ROMAN_TESTS},
    fix=[("numerals/roman.py", '''    total = 0
    for ch in numeral.upper():
        if ch not in _VALUES:
            raise ValueError(f"not a roman digit: {ch!r}")
        total += _VALUES[ch]
    return total
''', '''    digits = numeral.upper()
    for ch in digits:
        if ch not in _VALUES:
            raise ValueError(f"not a roman digit: {ch!r}")
    total = 0
    for i, ch in enumerate(digits):
        value = _VALUES[ch]
        if i + 1 < len(digits) and value < _VALUES[digits[i + 1]]:
            total -= value
        else:
            total += value
    return total
''')],
    hidden_tests={"tests/test_roman.py": _ROMAN_TESTS + d('''


        def test_subtractive():
            assert roman_to_int("IV") == 4
            assert roman_to_int("MCMXCIV") == 1994
    ''')},
)

# ── 11 ──────────────────────────────────────────────────────────────────────────────────────
_SIZE = d('''
    """Human-readable byte sizes."""

    _UNITS = ["B", "KiB", "MiB", "GiB", "TiB"]


    def human_size(num_bytes: int) -> str:
        size = float(num_bytes)
        for unit in _UNITS[:-1]:
            if size <= 1024:
                return f"{size:.1f} {unit}"
            size /= 1024
        return f"{size:.1f} {_UNITS[-1]}"
''')
_SIZE_TESTS = d('''
    from bytefmt.size import human_size


    def test_bytes():
        assert human_size(512) == "512.0 B"


    def test_mebibytes():
        assert human_size(5 * 1024 * 1024 + 1) == "5.0 MiB"
''')
spec(
    id="bytefmt__unit-boundary",
    issue='''
        human_size(1024) prints "1024.0 B"

        Exactly 1024 bytes should be shown as "1.0 KiB" (and 1048576 as "1.0 MiB"), like every other
        tool does; right now each unit boundary stays in the smaller unit.
    ''',
    files={"bytefmt/__init__.py": "", "bytefmt/size.py": _SIZE},
    visible_tests={"tests/test_size.py": _SIZE_TESTS},
    fix=[("bytefmt/size.py", "        if size <= 1024:\n", "        if size < 1024:\n")],
    hidden_tests={"tests/test_size.py": _SIZE_TESTS + d('''


        def test_exact_boundaries_move_up():
            assert human_size(1024) == "1.0 KiB"
            assert human_size(1024 * 1024) == "1.0 MiB"
    ''')},
)

# ── 12 ──────────────────────────────────────────────────────────────────────────────────────
_MONEY = d('''
    """Splitting amounts of money held as integer cents."""


    def split_amount(total_cents: int, parts: int) -> list[int]:
        """`parts` shares of `total_cents` that differ by at most one cent and add up to it."""
        if parts < 1:
            raise ValueError("parts must be at least 1")
        share = total_cents // parts
        return [share] * parts
''')
_MONEY_TESTS = d('''
    from ledger.split import split_amount


    def test_even_split():
        assert split_amount(900, 3) == [300, 300, 300]


    def test_one_part():
        assert split_amount(7, 1) == [7]
''')
spec(
    id="ledger__split-loses-cents",
    issue='''
        split_amount loses cents

        Splitting a 10.00 bill three ways: `split_amount(1000, 3)` returns `[333, 333, 333]`, which adds up
        to 9.99. The shares must add up to the total (first shares get the extra cent): `[334, 333, 333]`.
    ''',
    files={"ledger/__init__.py": "", "ledger/split.py": _MONEY},
    visible_tests={"tests/test_split.py": _MONEY_TESTS},
    fix=[("ledger/split.py", '''    share = total_cents // parts
    return [share] * parts
''', '''    share, extra = divmod(total_cents, parts)
    return [share + 1] * extra + [share] * (parts - extra)
''')],
    hidden_tests={"tests/test_split.py": _MONEY_TESTS + d('''


        def test_remainder_is_distributed():
            assert split_amount(1000, 3) == [334, 333, 333]
            assert sum(split_amount(1001, 4)) == 1001
    ''')},
)

# ── 13 ──────────────────────────────────────────────────────────────────────────────────────
_DUR = d('''
    """Parse durations like "1h30m" or "45s" into seconds."""
    import re

    _PART = re.compile(r"(\\d+)([hms])")
    _SCALE = {"h": 3600, "m": 60, "s": 1}


    def parse_duration(text: str) -> int:
        text = text.strip().lower()
        m = _PART.match(text)
        if not m or m.end() != len(text):
            raise ValueError(f"not a duration: {text!r}")
        return int(m.group(1)) * _SCALE[m.group(2)]
''')
_DUR_TESTS = d('''
    from timefmt.duration import parse_duration


    def test_single_units():
        assert parse_duration("45s") == 45
        assert parse_duration("2h") == 7200


    def test_garbage_is_refused():
        for bad in ("", "h", "10x"):
            try:
                parse_duration(bad)
            except ValueError:
                continue
            raise AssertionError(bad)
''')
spec(
    id="timefmt__compound-durations",
    issue='''
        parse_duration("1h30m") raises ValueError

        Compound durations are documented in the module docstring ("1h30m") but only single units work:
        `parse_duration("1h30m")` raises `ValueError: not a duration: '1h30m'`. Expected 5400, and
        "1m5s" -> 65.
    ''',
    files={"timefmt/__init__.py": "", "timefmt/duration.py": _DUR},
    visible_tests={"tests/test_duration.py": _DUR_TESTS},
    fix=[("timefmt/duration.py", '''    m = _PART.match(text)
    if not m or m.end() != len(text):
        raise ValueError(f"not a duration: {text!r}")
    return int(m.group(1)) * _SCALE[m.group(2)]
''', '''    if not text or _PART.sub("", text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * _SCALE[unit] for n, unit in _PART.findall(text))
''')],
    hidden_tests={"tests/test_duration.py": _DUR_TESTS + d('''


        def test_compound():
            assert parse_duration("1h30m") == 5400
            assert parse_duration("1m5s") == 65
    ''')},
)

# ── 14 ──────────────────────────────────────────────────────────────────────────────────────
_WRAP = d('''
    """Greedy word wrapping."""


    def wrap(text: str, width: int) -> list[str]:
        lines, current = [], ""
        for word in text.split():
            candidate = f"{current} {word}" if current else word
            if len(candidate) < width:
                current = candidate
            else:
                if current:
                    lines.append(current)
                current = word
        if current:
            lines.append(current)
        return lines
''')
_WRAP_TESTS = d('''
    from textwrap_lite.wrap import wrap


    def test_wraps_long_text():
        assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


    def test_empty():
        assert wrap("", 5) == []
''')
spec(
    id="textwrap_lite__exact-width",
    issue='''
        wrap() breaks lines that exactly fit the width

        `wrap("aaa bbb", 7)` returns `["aaa", "bbb"]` although "aaa bbb" is exactly 7 characters and fits.
        Lines up to and including `width` characters should be kept together.
    ''',
    files={"textwrap_lite/__init__.py": "", "textwrap_lite/wrap.py": _WRAP},
    visible_tests={"tests/test_wrap.py": _WRAP_TESTS},
    fix=[("textwrap_lite/wrap.py", "        if len(candidate) < width:\n", "        if len(candidate) <= width:\n")],
    hidden_tests={"tests/test_wrap.py": _WRAP_TESTS + d('''


        def test_line_of_exact_width_fits():
            assert wrap("aaa bbb", 7) == ["aaa bbb"]
            assert wrap("aaa bbb ccc", 7) == ["aaa bbb", "ccc"]
    ''')},
)

# ── 15 ──────────────────────────────────────────────────────────────────────────────────────
_INV = d('''
    """Stock levels of a small shop."""


    class Inventory:
        def __init__(self) -> None:
            self._stock: dict[str, int] = {}

        def add(self, sku: str, qty: int = 1) -> None:
            self._stock[sku] = self._stock.get(sku, 0) + qty

        def remove(self, sku: str, qty: int = 1) -> None:
            have = self._stock.get(sku, 0)
            if qty > have:
                raise ValueError(f"only {have} of {sku} in stock")
            self._stock[sku] = have - qty

        def skus(self) -> list[str]:
            """The SKUs in stock, sorted."""
            return sorted(self._stock)

        def quantity(self, sku: str) -> int:
            return self._stock.get(sku, 0)
''')
_INV_TESTS = d('''
    from shop.inventory import Inventory


    def test_add_and_remove():
        inv = Inventory()
        inv.add("apple", 3)
        inv.remove("apple", 2)
        assert inv.quantity("apple") == 1


    def test_cannot_remove_more_than_stock():
        inv = Inventory()
        inv.add("pear")
        try:
            inv.remove("pear", 2)
        except ValueError:
            return
        raise AssertionError("no ValueError")
''')
spec(
    id="shop__sold-out-skus-listed",
    issue='''
        Sold-out items still listed as in stock

        After selling the last unit (`inv.add("apple"); inv.remove("apple")`), `inv.skus()` still returns
        `["apple"]`, so the storefront shows an item we cannot sell. `skus()` is documented as "the SKUs in
        stock"; an item whose quantity reaches zero should disappear from it.
    ''',
    files={"shop/__init__.py": "", "shop/inventory.py": _INV},
    visible_tests={"tests/test_inventory.py": _INV_TESTS},
    fix=[("shop/inventory.py", '''        self._stock[sku] = have - qty
''', '''        if have == qty:
            self._stock.pop(sku, None)
        else:
            self._stock[sku] = have - qty
''')],
    hidden_tests={"tests/test_inventory.py": _INV_TESTS + d('''


        def test_sold_out_sku_is_not_listed():
            inv = Inventory()
            inv.add("apple")
            inv.add("kiwi", 2)
            inv.remove("apple")
            assert inv.skus() == ["kiwi"]
            assert inv.quantity("apple") == 0
    ''')},
)

# ── 16 ──────────────────────────────────────────────────────────────────────────────────────
_BUS = d('''
    """A synchronous publish/subscribe event bus."""
    from collections import defaultdict


    class EventBus:
        def __init__(self) -> None:
            self._handlers = defaultdict(list)

        def subscribe(self, event: str, handler) -> None:
            self._handlers[event].append(handler)

        def unsubscribe(self, event: str, handler) -> None:
            self._handlers[event].remove(handler)

        def emit(self, event: str, *args) -> int:
            """Call every handler of `event`; returns how many were called."""
            called = 0
            for handler in self._handlers[event]:
                handler(*args)
                called += 1
            return called
''')
_BUS_TESTS = d('''
    from eventbus.bus import EventBus


    def test_emit_calls_handlers_in_order():
        bus, seen = EventBus(), []
        bus.subscribe("x", lambda v: seen.append(("a", v)))
        bus.subscribe("x", lambda v: seen.append(("b", v)))
        assert bus.emit("x", 1) == 2
        assert seen == [("a", 1), ("b", 1)]


    def test_unsubscribe():
        bus, seen = EventBus(), []
        handler = seen.append
        bus.subscribe("x", handler)
        bus.unsubscribe("x", handler)
        assert bus.emit("x", 1) == 0 and seen == []
''')
spec(
    id="eventbus__unsubscribe-during-emit",
    issue='''
        A one-shot handler that unsubscribes itself makes the next handler miss the event

        ```python
        def once(v):
            bus.unsubscribe("x", once)
        bus.subscribe("x", once)
        bus.subscribe("x", print)
        bus.emit("x", 1)   # print is never called
        ```
        Every handler subscribed when `emit` starts should be called, whatever handlers do to the
        subscriptions meanwhile.
    ''',
    files={"eventbus/__init__.py": "", "eventbus/bus.py": _BUS},
    visible_tests={"tests/test_bus.py": _BUS_TESTS},
    fix=[("eventbus/bus.py", "        for handler in self._handlers[event]:\n",
          "        for handler in list(self._handlers[event]):\n")],
    hidden_tests={"tests/test_bus.py": _BUS_TESTS + d('''


        def test_handler_unsubscribing_itself_does_not_skip_others():
            bus, seen = EventBus(), []

            def once(v):
                bus.unsubscribe("x", once)

            bus.subscribe("x", once)
            bus.subscribe("x", seen.append)
            assert bus.emit("x", 1) == 2
            assert seen == [1]
            assert bus.emit("x", 2) == 1
    ''')},
)

# ── 17 ──────────────────────────────────────────────────────────────────────────────────────
_VER = d('''
    """Compare dotted version strings."""


    def compare_versions(a: str, b: str) -> int:
        """-1, 0 or 1 as version `a` is older than, equal to or newer than `b`."""
        pa, pb = a.split("."), b.split(".")
        width = max(len(pa), len(pb))
        pa += ["0"] * (width - len(pa))
        pb += ["0"] * (width - len(pb))
        return (pa > pb) - (pa < pb)
''')
_VER_TESTS = d('''
    from semverish.compare import compare_versions


    def test_equal_with_padding():
        assert compare_versions("1.2", "1.2.0") == 0


    def test_simple_order():
        assert compare_versions("1.2.3", "1.2.4") == -1
        assert compare_versions("2.0", "1.9") == 1
''')
spec(
    id="semverish__numeric-components",
    issue='''
        compare_versions says 1.10 is older than 1.9

        `compare_versions("1.10", "1.9")` returns -1. Version components are numbers, so 1.10 is newer.
        This broke our "update available" check when we released 1.10.
    ''',
    files={"semverish/__init__.py": "", "semverish/compare.py": _VER},
    visible_tests={"tests/test_compare.py": _VER_TESTS},
    fix=[("semverish/compare.py", '''    pa, pb = a.split("."), b.split(".")
    width = max(len(pa), len(pb))
    pa += ["0"] * (width - len(pa))
    pb += ["0"] * (width - len(pb))
''', '''    pa, pb = [int(x) for x in a.split(".")], [int(x) for x in b.split(".")]
    width = max(len(pa), len(pb))
    pa += [0] * (width - len(pa))
    pb += [0] * (width - len(pb))
''')],
    hidden_tests={"tests/test_compare.py": _VER_TESTS + d('''


        def test_components_compare_as_numbers():
            assert compare_versions("1.10", "1.9") == 1
            assert compare_versions("1.9.2", "1.10") == -1
    ''')},
)

# ── 18 ──────────────────────────────────────────────────────────────────────────────────────
_FLAT = d('''
    """Flatten nested lists and tuples."""


    def flatten(items):
        out = []
        for item in items:
            if hasattr(item, "__iter__"):
                out.extend(flatten(item))
            else:
                out.append(item)
        return out
''')
_FLAT_TESTS = d('''
    from nested.flat import flatten


    def test_numbers():
        assert flatten([1, [2, [3, (4, 5)]], 6]) == [1, 2, 3, 4, 5, 6]


    def test_empty():
        assert flatten([[], [[]]]) == []
''')
spec(
    id="nested__flatten-strings",
    issue='''
        flatten() crashes with RecursionError on strings

        `flatten(["ab", ["cd"]])` raises `RecursionError: maximum recursion depth exceeded` (a one-character
        string iterates over itself). Strings and bytes are values, not containers:
        expected `["ab", "cd"]`.
    ''',
    files={"nested/__init__.py": "", "nested/flat.py": _FLAT},
    visible_tests={"tests/test_flat.py": _FLAT_TESTS},
    fix=[("nested/flat.py", '''        if hasattr(item, "__iter__"):
''', '''        if hasattr(item, "__iter__") and not isinstance(item, (str, bytes)):
''')],
    hidden_tests={"tests/test_flat.py": _FLAT_TESTS + d('''


        def test_strings_are_values():
            assert flatten(["ab", ["cd", [b"e"]]]) == ["ab", "cd", b"e"]
    ''')},
)

# ── 19 ──────────────────────────────────────────────────────────────────────────────────────
_MAT = d('''
    """Matrices as lists of rows."""


    def transpose(rows):
        if not rows:
            return []
        n = len(rows)
        return [[rows[r][c] for r in range(n)] for c in range(n)]


    def matmul(a, b):
        bt = transpose(b)
        return [[sum(x * y for x, y in zip(row, col)) for col in bt] for row in a]
''')
_MAT_TESTS = d('''
    from linalg_lite.matrix import matmul, transpose


    def test_square_transpose():
        assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


    def test_square_matmul():
        assert matmul([[1, 0], [0, 1]], [[5, 6], [7, 8]]) == [[5, 6], [7, 8]]
''')
spec(
    id="linalg_lite__transpose-rectangular",
    issue='''
        transpose() fails for non-square matrices

        `transpose([[1, 2, 3], [4, 5, 6]])` raises `IndexError: list index out of range`; it should return
        `[[1, 4], [2, 5], [3, 6]]`. `matmul` of a 2x3 by a 3x2 matrix fails the same way.
    ''',
    files={"linalg_lite/__init__.py": "", "linalg_lite/matrix.py": _MAT},
    visible_tests={"tests/test_matrix.py": _MAT_TESTS},
    fix=[("linalg_lite/matrix.py", '''    n = len(rows)
    return [[rows[r][c] for r in range(n)] for c in range(n)]
''', '''    return [[row[c] for row in rows] for c in range(len(rows[0]))]
''')],
    hidden_tests={"tests/test_matrix.py": _MAT_TESTS + d('''


        def test_rectangular():
            assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
            assert matmul([[1, 2, 3], [4, 5, 6]], [[1, 0], [0, 1], [1, 1]]) == [[4, 5], [10, 11]]
    ''')},
)

# ── 20 ──────────────────────────────────────────────────────────────────────────────────────
_BUCKET = d('''
    """A token-bucket rate limiter with an injectable clock."""
    import time


    class TokenBucket:
        def __init__(self, rate: float, capacity: int, clock=time.monotonic) -> None:
            self.rate = rate
            self.capacity = capacity
            self._clock = clock
            self._tokens = float(capacity)
            self._last = clock()

        def allow(self) -> bool:
            now = self._clock()
            self._tokens += (now - self._last) * self.rate
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False
''')
_BUCKET_TESTS = d('''
    from ratelimit.bucket import TokenBucket


    class Clock:
        def __init__(self):
            self.t = 0.0

        def __call__(self):
            return self.t


    def test_burst_up_to_capacity():
        clock = Clock()
        b = TokenBucket(rate=1, capacity=3, clock=clock)
        assert [b.allow() for _ in range(4)] == [True, True, True, False]


    def test_refills_over_time():
        clock = Clock()
        b = TokenBucket(rate=2, capacity=1, clock=clock)
        assert b.allow() and not b.allow()
        clock.t = 0.5
        assert b.allow()
''')
spec(
    id="ratelimit__bucket-overfills",
    issue='''
        TokenBucket allows bursts far above its capacity after being idle

        With `TokenBucket(rate=1, capacity=3)`, after 100 idle seconds 100 requests in a row are allowed.
        The bucket should never hold more than `capacity` tokens, so at most 3 requests may burst.
    ''',
    files={"ratelimit/__init__.py": "", "ratelimit/bucket.py": _BUCKET},
    visible_tests={"tests/test_bucket.py": _BUCKET_TESTS},
    fix=[("ratelimit/bucket.py", "        self._tokens += (now - self._last) * self.rate\n",
          "        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)\n")],
    hidden_tests={"tests/test_bucket.py": _BUCKET_TESTS + d('''


        def test_idle_time_does_not_overfill():
            clock = Clock()
            b = TokenBucket(rate=1, capacity=3, clock=clock)
            clock.t = 100.0
            assert [b.allow() for _ in range(4)] == [True, True, True, False]
    ''')},
)

# ── 21 ──────────────────────────────────────────────────────────────────────────────────────
_CASE = d('''
    """Convert identifiers between naming conventions."""
    import re


    def camel_to_snake(name: str) -> str:
        return re.sub(r"(?<!^)([A-Z])", r"_\\1", name).lower()


    def snake_to_camel(name: str) -> str:
        head, *rest = name.split("_")
        return head + "".join(part.title() for part in rest)
''')
_CASE_TESTS = d('''
    from casing.convert import camel_to_snake, snake_to_camel


    def test_camel_to_snake_simple():
        assert camel_to_snake("parseHttpResponse") == "parse_http_response"
        assert camel_to_snake("Value") == "value"


    def test_snake_to_camel():
        assert snake_to_camel("parse_http_response") == "parseHttpResponse"
''')
spec(
    id="casing__acronyms",
    issue='''
        camel_to_snake splits acronyms into single letters

        `camel_to_snake("HTTPServer")` gives `"h_t_t_p_server"` and `camel_to_snake("parseJSON")` gives
        `"parse_j_s_o_n"`. Expected `"http_server"` and `"parse_json"`: a run of capitals is one word, and the
        last capital of the run starts the next word when a lower-case letter follows.
    ''',
    files={"casing/__init__.py": "", "casing/convert.py": _CASE},
    visible_tests={"tests/test_convert.py": _CASE_TESTS},
    fix=[("casing/convert.py", '''    return re.sub(r"(?<!^)([A-Z])", r"_\\1", name).lower()
''', '''    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", name).lower()
''')],
    hidden_tests={"tests/test_convert.py": _CASE_TESTS + d('''


        def test_acronyms_stay_together():
            assert camel_to_snake("HTTPServer") == "http_server"
            assert camel_to_snake("parseJSON") == "parse_json"
            assert camel_to_snake("getHTTPResponseCode") == "get_http_response_code"
    ''')},
)

# ── 22 ──────────────────────────────────────────────────────────────────────────────────────
_INTV = d('''
    """Merge overlapping closed intervals."""


    def merge_intervals(intervals):
        """Sorted, non-overlapping intervals covering the same points as `intervals`."""
        merged = []
        for start, end in intervals:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [tuple(i) for i in merged]
''')
_INTV_TESTS = d('''
    from intervals.merge import merge_intervals


    def test_sorted_input():
        assert merge_intervals([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]


    def test_touching_intervals_merge():
        assert merge_intervals([(1, 2), (2, 4)]) == [(1, 4)]
''')
spec(
    id="intervals__unsorted-input",
    issue='''
        merge_intervals gives overlapping output for unsorted input

        `merge_intervals([(8, 10), (1, 3), (2, 9)])` returns `[(8, 10), (1, 9)]`: not sorted, and the two
        intervals overlap. The docstring promises sorted, non-overlapping intervals for any input order;
        expected `[(1, 10)]`.
    ''',
    files={"intervals/__init__.py": "", "intervals/merge.py": _INTV},
    visible_tests={"tests/test_merge.py": _INTV_TESTS},
    fix=[("intervals/merge.py", "    for start, end in intervals:\n",
          "    for start, end in sorted(intervals):\n")],
    hidden_tests={"tests/test_merge.py": _INTV_TESTS + d('''


        def test_unsorted_input():
            assert merge_intervals([(8, 10), (1, 3), (2, 9)]) == [(1, 10)]
            assert merge_intervals([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]
    ''')},
)

# ── 23 ──────────────────────────────────────────────────────────────────────────────────────
_TAGS = d('''
    """Tagging of notes."""


    class Note:
        def __init__(self, text: str, tags: list[str] = []) -> None:
            self.text = text
            self.tags = tags

        def tag(self, name: str) -> None:
            if name not in self.tags:
                self.tags.append(name)
''')
_TAGS_TESTS = d('''
    from notes.note import Note


    def test_tagging():
        n = Note("buy milk", ["todo"])
        n.tag("shopping")
        n.tag("todo")
        assert n.tags == ["todo", "shopping"]
''')
spec(
    id="notes__shared-default-tags",
    issue='''
        Tags leak between notes

        ```python
        a = Note("first"); a.tag("work")
        b = Note("second")
        b.tags   # -> ["work"]  ?!
        ```
        A new note without tags should start with no tags. Notes created with a tag list should also not
        share that list with the caller (`tags = ["x"]; Note("t", tags).tag("y")` changes `tags`).
    ''',
    files={"notes/__init__.py": "", "notes/note.py": _TAGS},
    visible_tests={"tests/test_note.py": _TAGS_TESTS},
    fix=[("notes/note.py", '''    def __init__(self, text: str, tags: list[str] = []) -> None:
        self.text = text
        self.tags = tags
''', '''    def __init__(self, text: str, tags: list[str] | None = None) -> None:
        self.text = text
        self.tags = list(tags or [])
''')],
    hidden_tests={"tests/test_note.py": _TAGS_TESTS + d('''


        def test_default_tags_are_not_shared():
            a = Note("first")
            a.tag("work")
            assert Note("second").tags == []


        def test_callers_list_is_copied():
            tags = ["x"]
            Note("t", tags).tag("y")
            assert tags == ["x"]
    ''')},
)

# ── 24 ──────────────────────────────────────────────────────────────────────────────────────
_PATH = d('''
    """Normalise slash-separated resource paths (URLs, archive members)."""


    def normalize(path: str) -> str:
        absolute = path.startswith("/")
        parts = []
        for part in path.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                parts.pop()
                continue
            parts.append(part)
        return ("/" if absolute else "") + "/".join(parts)
''')
_PATH_TESTS = d('''
    from respath.normalize import normalize


    def test_dots_and_slashes():
        assert normalize("/a//b/./c/") == "/a/b/c"


    def test_parent_inside():
        assert normalize("a/b/../c") == "a/c"
''')
spec(
    id="respath__parent-above-root",
    issue='''
        normalize("/..") crashes with IndexError

        `normalize("/../a")` raises `IndexError: pop from empty list`. For an absolute path, ".." at the root
        stays at the root (like POSIX): expected "/a". For a relative path the leading ".." must be kept:
        `normalize("../a/../b")` should be "../b".
    ''',
    files={"respath/__init__.py": "", "respath/normalize.py": _PATH},
    visible_tests={"tests/test_normalize.py": _PATH_TESTS},
    fix=[("respath/normalize.py", '''        if part == "..":
            parts.pop()
            continue
''', '''        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not absolute:
                parts.append("..")
            continue
''')],
    hidden_tests={"tests/test_normalize.py": _PATH_TESTS + d('''


        def test_parent_of_root():
            assert normalize("/../a") == "/a"
            assert normalize("/..") == "/"


        def test_leading_parents_of_relative_path_are_kept():
            assert normalize("../a/../b") == "../b"
            assert normalize("../../x") == "../../x"
    ''')},
)

//! Text tables of the scenarios' reports: one home for sizing their columns.

/// The width of a column: the widest cell `cell` gives over `rows`, at least `header` (the
/// header's width), in characters.
pub(crate) fn column_width<R>(rows: &[R], cell: impl Fn(&R) -> &str, header: usize) -> usize {
    rows.iter()
        .map(|r| cell(r).chars().count())
        .max()
        .unwrap_or(0)
        .max(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_is_as_wide_as_its_widest_cell_or_header_in_characters() {
        let rows = ["ab", "µµµ", ""];
        assert_eq!(column_width(&rows, |r| r, 1), 3);
        assert_eq!(column_width(&rows, |r| r, 5), 5);
        assert_eq!(column_width::<&str>(&[], |r| r, 4), 4);
    }
}

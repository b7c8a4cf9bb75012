use crate::error::{ConfigError, FieldError};
use crate::object::{collect_objects, Object};

/// Objects one file may hold: a real config of 10,000 routes plus their policies fits;
/// the parser's default (1,024 documents) does not.
pub const MAX_DOCUMENTS: usize = 100_000;

/// Parses a file of config objects: YAML (several documents separated by `---`) or JSON
/// (one object, or an array of objects). Collects the errors of every document.
pub fn parse_documents(text: &str) -> Result<Vec<Object>, ConfigError> {
    // The other limits keep protecting against alias and nesting bombs; only the sizes
    // that grow with the number of objects are raised, in proportion.
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_documents: MAX_DOCUMENTS,
            max_nodes: 100 * MAX_DOCUMENTS,
            max_events: 400 * MAX_DOCUMENTS,
        },
    };
    let values: Vec<serde_json::Value> = serde_saphyr::from_multiple_with_options(text, options)
        .map_err(|error| FieldError::new("input", "", format!("malformed YAML/JSON: {error}")))?;
    let documents = values.into_iter().flat_map(|value| match value {
        serde_json::Value::Array(items) => items,
        serde_json::Value::Null => Vec::new(),
        other => vec![other],
    });
    collect_objects(
        documents
            .enumerate()
            .map(|(index, value)| Object::from_json(value, &format!("document {}", index + 1))),
    )
}

/// Renders objects as a multi-document YAML stream that [`parse_documents`] reads back.
pub fn to_yaml<'a>(objects: impl IntoIterator<Item = &'a Object>) -> String {
    let values: Vec<serde_json::Value> = objects.into_iter().map(Object::to_json).collect();
    values
        .iter()
        .filter_map(|value| serde_saphyr::to_string(value).ok())
        .collect::<Vec<_>>()
        .join("---\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_yaml_is_an_error() {
        let error = parse_documents("kind: [unclosed").unwrap_err().to_string();
        assert!(error.starts_with("input: malformed YAML/JSON"), "{error}");
    }

    #[test]
    fn json_array_is_accepted_and_yaml_round_trips() {
        let json = r#"[{"apiVersion":"portcullis.dev/v1alpha1","kind":"Backend","metadata":{"name":"a"},"spec":{"endpoints":["127.0.0.1:1"]}}]"#;
        let objects = parse_documents(json).unwrap();
        assert_eq!(objects.len(), 1);
        let yaml = to_yaml(&objects);
        assert_eq!(parse_documents(&yaml).unwrap(), objects);
    }

    #[test]
    fn errors_from_every_document_are_reported() {
        let text = "apiVersion: portcullis.dev/v1alpha1\nkind: Nope\nmetadata: {name: a}\nspec: {}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: b}\nspec: {port: 0}\n";
        let error = parse_documents(text).unwrap_err();
        assert_eq!(error.errors.len(), 2, "{error}");
        assert_eq!(
            error.errors[1].to_string(),
            "Listener/b: spec.port: port must be between 1 and 65535"
        );
    }

    #[test]
    fn ten_thousand_documents_parse() {
        let text: String = (0..10_000)
            .map(|index| {
                format!("apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: b{index}}}\nspec: {{endpoints: ['127.0.0.1:1']}}\n---\n")
            })
            .collect();
        assert_eq!(parse_documents(&text).unwrap().len(), 10_000);
    }

    #[test]
    fn out_of_range_port_names_the_field() {
        let text =
            "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: b}\nspec: {port: 70000}\n";
        let error = parse_documents(text).unwrap_err().to_string();
        assert!(error.starts_with("Listener/b: spec.port:"), "{error}");
    }
}

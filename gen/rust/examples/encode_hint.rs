//! Builds a Retain hint batch, encodes it as the ApplyHints request body and
//! decodes it back. Run: `cd gen/rust && cargo run --offline --example encode_hint`.

use kvhint_proto::v1;
use prost::Message;

fn main() {
    let req = v1::ApplyHintsRequest {
        hints: vec![v1::Hint {
            hint_id: "example-1".into(),
            selector: Some(v1::Selector {
                target: Some(v1::selector::Target::Session(v1::SessionSelector {
                    session_id: "session-a".into(),
                    include_children: false,
                })),
                range: None,
            }),
            max_blocks: 0,
            action: Some(v1::hint::Action::Retain(v1::RetainAction {
                priority: 10,
                ttl: Some(prost_types::Duration {
                    seconds: 300,
                    nanos: 0,
                }),
                expected_reuse_in: None,
            })),
        }],
    };
    let bytes = req.encode_to_vec();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "{} ApplyHintsRequest: {} bytes: {}",
        kvhint_proto::PROTOCOL_VERSION,
        bytes.len(),
        hex
    );
    let back = v1::ApplyHintsRequest::decode(bytes.as_slice()).expect("decode");
    assert_eq!(back, req);
    println!("decoded: {:?}", back.hints[0]);
}

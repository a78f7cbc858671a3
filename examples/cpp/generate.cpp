// Greedy generation from two AOTInductor packages, with no Python in the process.
//
//   mla_generate prefill.pt2 decode.pt2 prompt.pt new_tokens out.pt
//
// prefill.pt2 / decode.pt2: export.export_prefill_step / export_decode_step of a Hugging Face MLA
//   model, compiled by export.aoti.compile_package(..., python_free=True) (the mla ops compiled
//   into the package; a package that calls them back through Python fails to load here, naming
//   mla::attention).
// prompt.pt: torch.save([input_ids, attention_mask, position_ids]) of the prompt, int64 [B, S].
// out.pt: (tokens [B, new_tokens] int64, logits [new_tokens, B, vocab]), read by torch.load.
//
// The packages' inputs and outputs, flattened in order:
//   prefill(input_ids [B, S], attention_mask [B, S], position_ids [B, S])
//     -> logits [B, S, vocab], then (key, value) per layer of the cache
//   decode(input_ids [B, 1], attention_mask [B, T+1], position_ids [B, 1], (key, value) per layer)
//     -> logits [B, 1, vocab], then the cache grown by one token
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::vector<at::Tensor> contiguous(std::vector<at::Tensor> tensors) {
  // The compiled code indexes inputs with the strides of the example inputs (contiguous).
  for (auto& t : tensors) t = t.contiguous();
  return tensors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: " << argv[0]
              << " prefill.pt2 decode.pt2 prompt.pt new_tokens out.pt\n";
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    torch::inductor::AOTIModelPackageLoader prefill(argv[1]);
    torch::inductor::AOTIModelPackageLoader decode(argv[2]);
    const int64_t new_tokens = std::stoll(argv[4]);
    if (new_tokens < 1) throw std::runtime_error("new_tokens must be at least 1");

    auto prompt = torch::pickle_load(read_file(argv[3])).toList();
    if (prompt.size() != 3) throw std::runtime_error("prompt.pt must hold 3 tensors");
    at::Tensor mask = prompt.get(1).toTensor();       // [B, S]
    at::Tensor positions = prompt.get(2).toTensor();  // [B, S]

    // The prompt pass: logits and the cache.
    auto outputs = prefill.run(contiguous(
        {prompt.get(0).toTensor(), mask, positions}));
    std::vector<at::Tensor> tokens, logits;
    for (int64_t step = 0; step < new_tokens; ++step) {
      at::Tensor last = outputs[0].select(1, -1);              // [B, vocab]
      at::Tensor next = last.argmax(-1, /*keepdim=*/true);     // [B, 1]
      tokens.push_back(next);
      logits.push_back(last);
      if (step + 1 == new_tokens) break;
      mask = torch::cat({mask, torch::ones_like(next)}, 1);    // [B, T+1]
      positions = positions.narrow(1, positions.size(1) - 1, 1) + 1;  // [B, 1]
      std::vector<at::Tensor> inputs = {next, mask, positions};
      inputs.insert(inputs.end(), outputs.begin() + 1, outputs.end());  // the cache
      outputs = decode.run(contiguous(std::move(inputs)));
    }
    auto result = c10::ivalue::Tuple::create(
        {torch::cat(tokens, 1), torch::stack(logits)});  // [B, new_tokens], [new_tokens, B, vocab]
    write_file(argv[5], torch::pickle_save(result));
  } catch (const std::exception& error) {
    std::cerr << "mla_generate: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
